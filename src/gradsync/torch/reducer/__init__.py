"""The gradient machinery behind :func:`gradsync.torch.DistributedOptimizer`.

:mod:`.factory` checks the arguments, picks the strategy (:func:`~.factory.pick_strategy`) and
wraps the optimizer; :mod:`.periods` is its mixin (a period: the backward passes of one step);
:mod:`.strategies` holds the reductions (per gradient, in buckets or bucket views, Adasum deltas);
:mod:`.gradients` is one round of gradient collectives and the contract every strategy keeps;
:mod:`.buckets` lays gradients out in flat buffers; :mod:`.parameter_check` checks once that every
rank holds the same parameters.
"""
