"""What a tensor is to gradsync, whatever its framework.

:mod:`.adapter` is the protocol one framework implements (:class:`~.adapter.ArrayAdapter`: dtype, shape,
device, a host view); :mod:`.dispatch` finds the adapter of any array (numpy, torch, cupy, jax,
DLPack); :mod:`.dtypes` names the dtypes gradsync moves and the accumulator each is reduced in;
:mod:`.device` is the protocol of a GPU framework's runtime (streams, events, copies), implemented by
``gradsync.torch.device`` and ``gradsync.cupy``.
"""
