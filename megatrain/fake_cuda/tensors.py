"""Device tensors of the fake CUDA backend: CPU data that says device "cuda", and the mode that keeps it so.

`FakeCudaTensor` is a plain CPU tensor to the C++ side (so autograd, kernels and CPU-only torch builds work)
whose Python face is device cuda:0. `FakeCudaMode`, a torch function mode active in every thread while the
backend is installed, sees every torch call: factories asked for device "cuda" run on the CPU and come back
as device tensors; an op mixing device tensors with host tensors (other than 0-dim scalars, as CUDA allows)
raises torch's own "Expected all tensors to be on the same device"; results of device ops are device tensors;
cross-device copies (`copy_`, `to`, `cuda`, `cpu`) are the only ways across, each an access of the current
stream (streams.py). Inside a backward pass, gradients the autograd engine made (plain tensors to Python)
are taken as being where their op ran: the check there only covers what Python code mixes in forward.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

CUDA = torch.device("cuda", 0)
_current = [0]  # the process's current device (torch.cuda.set_device): a torchrun rank's is its local rank


def current_device() -> torch.device:
    return torch.device("cuda", _current[0])
_MISMATCH = ("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
             "(fake CUDA: {what})")


def _state():
    from .streams import state

    return state()


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor presenting itself on device cuda:0 (Python attributes only; torch kernels see the CPU)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return current_device()

    @property
    def is_cuda(self):
        return True

    @property
    def is_cpu(self):
        return False

    @property
    def grad(self):
        g = torch.Tensor.grad.__get__(self)
        return g if g is None or isinstance(g, FakeCudaTensor) else as_device(g)

    @grad.setter
    def grad(self, value):
        torch.Tensor.grad.__set__(self, value)

    def __repr__(self, *, tensor_contents=None):
        return f"FakeCudaTensor({torch.Tensor.__repr__(self.as_subclass(torch.Tensor))}, device='{self.device}')"


def on_device(t: torch.Tensor) -> bool:
    """A device tensor, or a plain view of device memory (what autograd hands Python in backward)."""
    if isinstance(t, FakeCudaTensor):
        return True
    if t.device.type != "cpu" or t.layout != torch.strided:
        return False
    with torch._C.DisableTorchFunction():
        st = _state().storages.get(t.untyped_storage().data_ptr())
    return st is not None and st.device


def as_device(t: torch.Tensor) -> FakeCudaTensor:
    """`t`'s data as a device tensor (the autograd graph kept), its storage counted as device memory."""
    if isinstance(t, FakeCudaTensor):
        return t
    out = t.as_subclass(FakeCudaTensor) if t.grad_fn is not None else \
        torch.Tensor._make_subclass(FakeCudaTensor, t, t.requires_grad)
    _track_device(out)
    return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunction():
        return t.as_subclass(torch.Tensor) if isinstance(t, FakeCudaTensor) else t


def _track_device(t: torch.Tensor) -> None:
    with torch._C.DisableTorchFunction():
        s = t.untyped_storage()
        if s.nbytes():
            _state().track(s, s.data_ptr(), s.nbytes(), device=True)


def _range(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage, lo, hi): the bytes `t` can touch."""
    with torch._C.DisableTorchFunction():
        if t.numel() == 0 or t.layout != torch.strided:
            return None
        s = t.untyped_storage()
        base = t.data_ptr()
        span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
        return s.data_ptr(), base, base + span * t.element_size()


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # an index: torch's convention for a CUDA device
    return torch.device(device).type == "cuda"


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensors among a call's arguments (torch functions take them directly or in one list)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _check_same_device(func, tensors) -> bool:
    """Whether the op runs on the device; raises where it mixes device and host tensors."""
    dev = [t for t in tensors if on_device(t)]
    if not dev:
        return False
    if not _in_backward():
        host = [t for t in tensors if t.dim() > 0 and t.device.type == "cpu" and not on_device(t)]
        if host:
            raise RuntimeError(_MISMATCH.format(what=f"{getattr(func, '__name__', func)} got a host tensor of "
                                                     f"shape {tuple(host[0].shape)}"))
    return True


def _record(reads, writes, label: str, device_op: bool) -> None:
    """An access by the current stream (a device op or a copy) or the host (a host op on tracked memory)."""
    st = _state()
    r = [x for x in map(_range, reads) if x is not None]
    w = [x for x in map(_range, writes) if x is not None]
    if device_op:
        for t in writes:  # a host buffer a stream writes is tracked from now on
            if not isinstance(t, FakeCudaTensor):
                _track_host(t)
        for t in reads:
            if not isinstance(t, FakeCudaTensor):
                _track_host(t)
        st.access(st.current(), r, w, label)
    elif any(x[0] in st.storages for x in (*r, *w)):
        st.access(st.host, r, w, label)


def _track_host(t: torch.Tensor) -> None:
    with torch._C.DisableTorchFunction():
        s = t.untyped_storage()
        if s.nbytes():
            _state().track(s, s.data_ptr(), s.nbytes(), device=False)


def is_pinned_range(t: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunction():
        if isinstance(t, FakeCudaTensor) or t.numel() == 0:
            return False
        p = t.data_ptr()
    return any(start <= p < start + n for start, n in _state().pinned.items())


# -- handlers of the calls that cross devices or synchronize ------------------------------------------------------
def _to_device(t: torch.Tensor, dtype=None, non_blocking=False, copy=False):
    src = _plain(t)
    out = src.to(dtype=dtype or src.dtype, copy=True)  # blocking or not, an h2d copy waits on nothing
    res = as_device(out)
    _record([t], [res], "h2d copy", True)
    return res


def _to_host(t: torch.Tensor, dtype=None, non_blocking=False):
    out = _plain(t).to(dtype=dtype or t.dtype, copy=True)
    _record([t], [out], "d2h copy", True)
    if not non_blocking:
        _state().synchronized(_state().current().snapshot(), "implicit blocking d2h copy")
    return out


def _parse_to(self, args, kwargs):
    device = kwargs.get("device")
    dtype = kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):
            device, dtype = a.device, a.dtype
        elif isinstance(a, (str, torch.device, int)):
            device = a
    return device, dtype, kwargs.get("non_blocking", False), kwargs.get("copy", False)


def _handle_to(func, args, kwargs):
    self = args[0]
    device, dtype, non_blocking, copy = _parse_to(self, args[1:], kwargs)
    here = on_device(self)
    want_device = here if device is None else _is_cuda_device(device)
    if want_device and not here:
        return _to_device(self, dtype, non_blocking)
    if here and not want_device:
        return _to_host(self, dtype, non_blocking)
    out = func(_plain(self), dtype=dtype or self.dtype, copy=copy, memory_format=kwargs.get(
        "memory_format", torch.preserve_format)) if here else func(*args, **kwargs)
    if here:
        if out is _plain(self) or out.data_ptr() == self.data_ptr() and out.dtype == self.dtype and not copy:
            return self
        out = as_device(out)
        _record([self], [out], "to", True)
    return out


def _handle_cuda(func, args, kwargs):
    self = args[0]
    if on_device(self):
        return as_device(self)
    return _to_device(self, non_blocking=kwargs.get("non_blocking", False))


def _handle_cpu(func, args, kwargs):
    self = args[0]
    return _to_host(self) if on_device(self) else func(*args, **kwargs)


def _handle_copy(func, args, kwargs):
    dst, src = args[0], args[1]
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    device_op = on_device(dst) or on_device(src)
    with torch._C.DisableTorchFunction():
        torch.Tensor.copy_(_plain(dst), _plain(src))
    _record([src], [dst], "copy_", device_op)
    if device_op and not on_device(dst) and not non_blocking:
        _state().synchronized(_state().current().snapshot(), "implicit blocking d2h copy_")
    return dst


def _handle_sync_read(func, args, kwargs):
    """A device value read on the host (.item(), .tolist(), bool()): it waits for the current stream, a
    synchronisation, unless the host already synchronized with every write of it (then it waits for nothing)."""
    if on_device(args[0]):
        st, r = _state(), _range(args[0])
        pending = r is not None and r[0] in st.storages and any(
            a.write and not st.knows(st.host, a.agent, a.seq) for a in st.storages[r[0]].accesses
            if a.hi > r[1] and a.lo < r[2])
        _record([args[0]], [], getattr(func, "__name__", "read"), True)
        # the read returns once its stream got there: complete for everyone, a wait only if it had work left
        st.synchronized(st.current().snapshot(), f"implicit {getattr(func, '__name__', 'read')}", log=pending)
        return func(_plain(args[0]), *args[1:], **kwargs)
    return func(*args, **kwargs)


def _handle_numpy(func, args, kwargs):
    if on_device(args[0]):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                        "to host memory first.")
    return func(*args, **kwargs)


def _handle_is_pinned(func, args, kwargs):
    return is_pinned_range(args[0])


def _handle_pin_memory(func, args, kwargs):
    if isinstance(args[0], FakeCudaTensor):
        raise RuntimeError("cannot pin 'FakeCudaTensor' only dense CPU tensors can be pinned")
    out = _plain(args[0]).clone()
    _pin(out)
    return out


def _pin(t: torch.Tensor) -> None:
    st = _state()
    with torch._C.DisableTorchFunction():
        s = t.untyped_storage()
        ptr, n = s.data_ptr(), s.nbytes()
    with st.lock:
        st.pinned[ptr] = n
        st.pool_pinned_bytes += n
    import weakref

    def unpin(ptr=ptr, n=n):
        with st.lock:
            if st.pinned.pop(ptr, None) is not None:
                st.pool_pinned_bytes -= n
    weakref.finalize(s, unpin)


def _handle_record_stream(func, args, kwargs):
    t, stream = args[0], args[1]
    r = _range(t)
    if r is not None:
        _state().record_stream(r[0], stream.agent)


def _handle_get_device(func, args, kwargs):
    return _current[0] if on_device(args[0]) else -1


_tls = __import__("threading").local()


def bypassing() -> bool:
    """Whether this thread runs autograd inside the mode (torch.autograd's has_torch_function answers no)."""
    return getattr(_tls, "autograd", False)


def _handle_autograd(func, args, kwargs):
    """backward and grad with the mode kept on: handle_torch_function pops the mode while its handler runs,
    and the autograd engine calls back into Python (custom Functions' backward, checkpoint recomputes),
    which must still see device tensors as such."""
    before = bypassing()
    _tls.autograd = True
    try:
        with FakeCudaMode():
            if func is torch.Tensor.backward:
                self, rest = args[0], args[1:]
                names = ("gradient", "retain_graph", "create_graph", "inputs")
                kw = {**dict(zip(names, rest)), **kwargs}
                return torch.autograd.backward(self, kw.get("gradient"), kw.get("retain_graph"),
                                               kw.get("create_graph", False), inputs=kw.get("inputs"))
            out = func(*args, **kwargs)
    finally:
        _tls.autograd = before
    if func is torch.autograd.grad:
        inputs = args[1] if len(args) > 1 else kwargs["inputs"]
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        out = tuple(as_device(g) if g is not None and isinstance(i, FakeCudaTensor) else g
                    for g, i in zip(out, inputs))
    return out


def _handle_sdpa(func, args, kwargs):
    from .kernels import sdpa

    tensors = _tensors(args, kwargs)
    if not _check_same_device(func, tensors):
        return func(*args, **kwargs)
    with FakeCudaMode():  # the mode pops itself while its handler runs: the ops below are device ops too
        return sdpa(*args, **kwargs)


def _handlers():
    T = torch.Tensor
    out = {T.to: _handle_to, T.cuda: _handle_cuda, T.cpu: _handle_cpu, T.copy_: _handle_copy,
           T.numpy: _handle_numpy, T.is_pinned: _handle_is_pinned, T.pin_memory: _handle_pin_memory,
           T.record_stream: _handle_record_stream, T.get_device: _handle_get_device,
           T.backward: _handle_autograd, torch.autograd.backward: _handle_autograd,
           torch.autograd.grad: _handle_autograd}
    from .kernels import gpu_only_kernels, register_attention

    register_attention()
    out[torch.nn.functional.scaled_dot_product_attention] = _handle_sdpa

    for op, kernel in gpu_only_kernels().items():
        out[op] = lambda func, args, kwargs, kernel=kernel: _wrap(kernel(*args, **kwargs), _tensors(args, kwargs),
                                                                  func)
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        out[getattr(T, name)] = _handle_sync_read
    return out


_HANDLERS = _handlers()
_OUT_DTYPE = __import__("megatrain.fake_cuda.kernels", fromlist=["with_out_dtype"]).with_out_dtype()
_PASS = {torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.data_ptr, torch.Tensor.untyped_storage,
         torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.element_size,
         torch.Tensor.__len__, torch.Tensor.requires_grad.__get__, torch.Tensor.is_leaf.__get__,
         torch._has_compatible_shallow_copy_type, torch.is_tensor, torch.is_floating_point, torch.is_complex}


class FakeCudaMode(TorchFunctionMode):
    """Active in every thread while the backend is installed (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if "out_dtype" in kwargs and func in _OUT_DTYPE:
            tensors = _tensors(args, kwargs)
            if _check_same_device(func, tensors):
                out = kwargs.get("out")
                res = _OUT_DTYPE[func](*[_plain(a) if isinstance(a, torch.Tensor) else a for a in args],
                                       **{k: _plain(v) if isinstance(v, torch.Tensor) else v
                                          for k, v in kwargs.items()})
                return _wrap(out if out is not None else res, tensors, func)
        if func in _PASS:
            return func(*args, **kwargs)
        to_device = _is_cuda_device(kwargs.get("device"))
        explicit_host = "device" in kwargs and kwargs["device"] is not None and not to_device
        if to_device:
            kwargs["device"] = "cpu"
        pin = bool(kwargs.pop("pin_memory", False))
        if func is torch.Tensor.new_empty or func is torch.Tensor.new_zeros or func is torch.Tensor.new_full \
                or func is torch.Tensor.new_ones or func is torch.Tensor.new_tensor:
            to_device = to_device or (isinstance(args[0], FakeCudaTensor) and not explicit_host)
        tensors = _tensors(args, kwargs)
        device_op = _check_same_device(func, tensors) and not explicit_host or to_device
        if device_op and to_device and "requires_grad" in kwargs:
            rg = kwargs.pop("requires_grad")
            out = func(*args, **kwargs)
            out = _wrap(out, tensors, func)
            return out.requires_grad_(rg) if rg else out
        out = func(*args, **kwargs)
        if pin and isinstance(out, torch.Tensor):
            _pin(out)
        if not device_op:
            if tensors and _state().storages and not _metadata(func, out, tensors):
                name = getattr(func, "__name__", "op")
                written = tensors[:1] if name.endswith("_") and not name.endswith("__") else []
                if isinstance(kwargs.get("out"), torch.Tensor):
                    written = [kwargs["out"]]
                _record([t for t in tensors if not any(t is w for w in written)], written, name, False)
            return out
        return _wrap(out, tensors, func)


def _storage_ptr(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunction():
        return t.untyped_storage().data_ptr() if t.layout == torch.strided else -1


# in-place by name, yet no kernel touches the data: autograd flags and in-place view changes (a forward's
# requires_grad_ on a slot's parameter views must not count as a write racing a copy that reads the slot)
_NO_DATA = {"requires_grad_", "retain_grad", "detach_", "squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_",
            "swapaxes_", "as_strided_"}


def _metadata(func, out, inputs) -> bool:
    """Whether a call reads no data: an attribute that is not a tensor, or a view of an input (no kernel)."""
    name = getattr(func, "__name__", "")
    if name in _NO_DATA:
        return True
    if (name == "__get__" or name.startswith("is_") and name != "is_nonzero") and not isinstance(out, torch.Tensor):
        return True  # an attribute or a layout question (is_contiguous): no kernel reads the data
    if isinstance(out, torch.Tensor) and not (name.endswith("_") and not name.endswith("__")):
        return out.numel() == 0 or _storage_ptr(out) in {_storage_ptr(t) for t in inputs}
    return False


_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _wrap(out, inputs, func):
    """Device results of a device op, recorded as the current stream's access."""
    ids = {id(t) for t in inputs}
    written = []
    name = getattr(func, "__name__", "")
    inplace = name.endswith("_") and not name.endswith("__")

    def wrap(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeCudaTensor) and id(x) not in ids:
            if x.device.type != "cpu":  # meta and friends stay what they are
                return x
            x = as_device(x)
            written.append(x)
        elif isinstance(x, torch.Tensor) and id(x) in ids and inplace:
            written.append(x)
        return x

    if _metadata(func, out, inputs):  # a view: device memory, no access
        return tree_map(lambda x: as_device(x) if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x,
                        out)
    out = tree_map(wrap, out)
    if name in _ALLOCATIONS:  # memory, no kernel: nothing to order yet (the allocating stream is recorded)
        return out
    if inplace and inputs and not written:
        written.append(inputs[0])
    reads = [t for t in inputs if not any(t is w for w in written)]
    _record(reads, written, name or "op", True)
    return out
