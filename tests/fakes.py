"""Stand-ins for cupy arrays, so GPU routing is tested on machines without a GPU."""

from __future__ import annotations


class FakeDevice:
    def __init__(self, device_id=0):
        self.id = device_id

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeCupyArray:
    """The attributes the checks read, slicing and assignment, around a NumPy array."""

    def __init__(self, host, device_id=0):
        self.host = host
        self.device = FakeDevice(device_id)

    shape = property(lambda self: self.host.shape)
    ndim = property(lambda self: self.host.ndim)
    dtype = property(lambda self: self.host.dtype)
    strides = property(lambda self: self.host.strides)
    itemsize = property(lambda self: self.host.itemsize)
    size = property(lambda self: self.host.size)

    def __getitem__(self, index):
        return FakeCupyArray(self.host[index], self.device.id)

    def __setitem__(self, index, value):
        self.host[index] = value.host if isinstance(value, FakeCupyArray) else value

    def get(self):
        return self.host
