"""torch's memory trackers as a measurement needs them (lab/memory/fake_run.py runs them on fake
tensors): the categories of the report, a category chosen by the caller, every live tensor booked
at the start, a peak per phase, FSDP units that are roots of their own, DTensor's propagation left
out, and repeated calls run once (`Replay`)."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from copy import deepcopy

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from parallel import torchapi

FEATURE = "the memory measurement (lab/memory/fake_run.py, lab/memory/trackers.py)"
# torch's private trackers and the internals they are extended through: a torch without one fails
# here, naming it (the measurement cannot run without them).
FakeTensor, FakeTensorMode, fsdp2_mem_tracker, mem_tracker, ShardingPropagator = torchapi.require(
    FEATURE, "torch._subclasses.fake_tensor.FakeTensor", "torch._subclasses.fake_tensor.FakeTensorMode",
    "torch.distributed._tools.fsdp2_mem_tracker", "torch.distributed._tools.mem_tracker",
    "torch.distributed.tensor._sharding_prop.ShardingPropagator")
torchapi.require(FEATURE, *(f"torch.distributed._tools.mem_tracker.{name}" for name in (
    "_RefType", "MemTracker._update_and_maybe_create_winfos", "MemTracker._track",
    "MemTracker._track_module_params_and_buffers", "MemTracker._pre_fw_hook", "MemTracker._update_peak_stats")),
    *(f"torch.distributed._tools.fsdp2_mem_tracker.{name}" for name in (
        "_FSDPState", "FSDPMemTracker._fsdp_state_pre_forward", "FSDPMemTracker._fsdp_param_group_post_backward")),
    "torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_non_cached",
    "torch.distributed.tensor.DTensor._local_tensor", "torch.distributed.fsdp.FSDPModule._get_fsdp_state",
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.unsharded_param")


@contextlib.contextmanager
def patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class Ref(mem_tracker._RefType):
    """Every category the trackers book (MemTracker's and FSDPMemTracker's names) and ours."""

    PARAM = "Parameter"
    BUFFER = "Buffer"
    GRAD = "Gradient"
    ACT = "Activation"
    TEMP = "Temp"
    OPT = "Optstate"
    OTH = "Other"
    SHARDED_PARAM = "Sharded Param"
    UNSHARDED_PARAM = "Unsharded Param"
    SHARDED_GRAD = "Sharded Grad"
    UNSHARDED_GRAD = "Unsharded Grad"
    ALL_GATHER = "All Gather"
    REDUCE_SCATTER = "Reduce Scatter"
    FSDP_OPT = "OptState"
    INP = "Inputs"
    COMM = "Communication"


CATEGORIES = {
    "parameters": ("Parameter", "Buffer", "Sharded Param", "Unsharded Param"),
    "gradients": ("Gradient", "Sharded Grad", "Unsharded Grad"),
    "optimizer": ("Optstate", "OptState"),
    "activations": ("Activation", "Temp"),
    "communication": ("All Gather", "Reduce Scatter", "Communication"),
    "other": ("Other", "Inputs"),
}
"""The report's categories, from the trackers' (FSDP's unsharded parameters are the gathered units)."""


# ----- DTensor sharding propagation ------------------------------------------------------------
_PROPAGATING = [0]


@contextlib.contextmanager
def uncounted_propagation():
    """Mark DTensor's sharding propagation so the trackers skip the global-size ops it runs."""
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def wrapped(self, *a, **k):
        _PROPAGATING[0] += 1
        try:
            return original(self, *a, **k)
        finally:
            _PROPAGATING[0] -= 1

    with patched(ShardingPropagator, "_propagate_tensor_meta_non_cached", wrapped):
        yield


# ----- trackers ----------------------------------------------------------------------------------
class _Window:
    """What both trackers add: a category we choose (`booking`), every live fake tensor booked
    when the tracker starts (`hold`), peaks per window (`window`), hooks only where a gradient can
    arrive, and a global peak without the per-module bookkeeping (which walks every module seen
    after every op: 80% of the run time; and refuses a module called twice at the top level)."""

    _booking = None

    def _setup(self):
        self._ref_class = Ref
        self._seen = weakref.WeakSet()

    @contextlib.contextmanager
    def booking(self, ref: Ref):
        """Book the tensors allocated inside as `ref` (e.g. communication buffers)."""
        old, self._booking = self._booking, ref
        try:
            yield
        finally:
            self._booking = old

    def _track(self, reftype, t):
        super()._track(self._booking or reftype, t)

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing: bool = False):
        """Tensors on the meta device are not on the GPU (released components, host memory's
        stand-in: lab/memory/fake_run.py): never booked."""
        if t.device.type == "meta":
            return set()
        return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _PROPAGATING[0]:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = deepcopy(snap)

    def _pre_fw_hook(self, module, inputs) -> None:
        if module not in self._seen:
            self._track_module_params_and_buffers(module, install_grad_hooks=True)
            self._seen.add(module)
        elif self._mod_tracker.is_bw and self._ac_mod is None:  # recomputed under checkpointing
            self._ac_mod, self._in_ac = weakref.ref(module), True

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod, self._in_ac = None, False

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        def grad_hook(grad):
            self._update_and_maybe_create_winfos(grad, Ref.GRAD)

        for p in module.parameters():
            self._update_and_maybe_create_winfos(p, Ref.PARAM)
            if p.grad is not None:
                self._update_and_maybe_create_winfos(p.grad, Ref.GRAD)
            if install_grad_hooks and p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                self._param_to_grad_hook_handles[p] = (p.register_hook(grad_hook),
                                                       p.register_post_accumulate_grad_hook(
                                                           lambda q: grad_hook(q.grad)))
        for b in module.buffers():
            self._update_and_maybe_create_winfos(b, Ref.BUFFER)
        return 0, 0

    def hold(self, mode: FakeTensorMode, optimizers=(), host=()) -> None:
        """Book every fake tensor of `mode` alive now, but the `host` tensors (in host memory in a
        real run): parameters, their gradients, optimizer state, the rest as Other (what the rank
        holds between phases). Tensors the tracker books already keep their category."""
        def local(t):
            return t._local_tensor if isinstance(t, DTensor) else t

        gc.collect()  # tensors in reference cycles that are already unreachable are not held
        host_storages = {id(local(t).untyped_storage()) for t in host}
        params, grads, states = set(), set(), set()
        for opt in optimizers:
            for state in opt.state.values():
                states.update(id(local(v)) for v in state.values() if isinstance(v, torch.Tensor))
        for obj in gc.get_objects():
            if isinstance(obj, torch.nn.Parameter):
                params.add(id(local(obj)))
                if obj.grad is not None:
                    grads.add(id(local(obj.grad)))
        for t in [o for o in gc.get_objects() if isinstance(o, FakeTensor) and o.fake_mode is mode]:
            storage = t.untyped_storage()
            if id(storage) in host_storages or self._WINFO.get(storage) is not None:
                continue
            ref = Ref.PARAM if id(t) in params else Ref.GRAD if id(t) in grads else \
                Ref.OPT if id(t) in states else Ref.OTH
            self._update_and_maybe_create_winfos(t, ref)

    @contextlib.contextmanager
    def window(self):
        """A peak of its own for the block: yields a dict filled with {category: bytes} at the
        block's peak and "total"."""
        self._peak_mem_snap = deepcopy(self._curr_mem_snap)
        self._peak_mem = {dev: snap.get("Total", 0) for dev, snap in self._curr_mem_snap.items()}
        out: dict[str, float] = {}
        yield out
        out.update(categories(self._only(self._peak_mem_snap)))

    def current(self) -> dict[str, float]:
        return categories(self._only(self._curr_mem_snap))

    @contextlib.contextmanager
    def excursion(self):
        """Measure the block alone: yields a dict that gets "above" (the block's peak above where
        it ends, by tracker key) and "made" (weak references to the storages it made that outlive
        it); the run's peak takes the block's peak as before."""
        outer_snap, outer = self._peak_mem_snap, self._peak_mem
        before = WeakIdKeyDictionary({st: True for st in self._WINFO.keys()})
        self._peak_mem_snap = deepcopy(self._curr_mem_snap)
        self._peak_mem = {dev: snap.get("Total", 0) for dev, snap in self._curr_mem_snap.items()}
        out: dict = {}
        try:
            yield out
        finally:
            peak, after = self._only(self._peak_mem_snap), self._only(self._curr_mem_snap)
            out["above"] = {k: peak.get(k, 0) - after.get(k, 0) for k in set(peak) | set(after)}
            out["made"] = [weakref.ref(st) for st in self._WINFO.keys() if st not in before]
            self._peak_mem_snap, self._peak_mem = outer_snap, outer
            self._update_peak_stats(None)
            if peak.get("Total", 0) > self._peak_mem.get(self._device(), 0):
                self._peak_mem_snap = {self._device(): peak}
                self._peak_mem = {self._device(): peak["Total"]}

    def bump(self, above: dict) -> None:
        """The peak of a block that would rise `above` (by tracker key) over where it is now."""
        now = self._only(self._curr_mem_snap)
        candidate = {k: now.get(k, 0) + above.get(k, 0) for k in set(now) | set(above)}
        if candidate.get("Total", 0) > self._peak_mem.get(self._device(), 0):
            self._peak_mem_snap = {self._device(): candidate}
            self._peak_mem = {self._device(): candidate["Total"]}

    def _only(self, snaps: dict) -> dict:
        return dict(snaps.get(self._device(), {}))

    @staticmethod
    def _device() -> torch.device:
        return torch.device("cpu")


def categories(snap: dict) -> dict[str, float]:
    """{category: bytes, "total": bytes} of one device's tracker snapshot."""
    out = {name: float(sum(snap.get(k, 0) for k in keys)) for name, keys in CATEGORIES.items()}
    out["total"] = float(snap.get("Total", 0))
    return out


class Tracker(_Window, mem_tracker.MemTracker):
    """MemTracker for a rank without FSDP."""

    def __init__(self):
        super().__init__()
        self._setup()


class FSDPTracker(_Window, fsdp2_mem_tracker.FSDPMemTracker):
    """FSDPMemTracker over a module whose FSDP units are its children (not itself an FSDP module),
    its hooks keeping only what the categories need (the unit's phase, its unsharded parameters
    and gradients): the adapters call every unit as a root of its own, once per forward."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        mem_tracker.MemTracker.__init__(self)
        self._root_mod, self._optm = module, optimizer
        self._fsdp_mod_to_saved_methods = WeakIdKeyDictionary()
        self._fsdp_state = _FSDP.PRE_FW
        self._setup()

    def _fsdp_state_pre_forward(self, fsdp_mod, original):
        def inner(*args, **kwargs):
            self._fsdp_state = _FSDP.PRE_FW
            args, kwargs = original(*args, **kwargs)
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            for p in group.fsdp_params if group else ():
                self._update_and_maybe_create_winfos(p.unsharded_param, Ref.UNSHARDED_PARAM)
            if self._mod_tracker.is_bw and self._ac_mod is None:
                self._ac_mod, self._in_ac = weakref.ref(fsdp_mod), True
            self._fsdp_state = _FSDP.FW
            return args, kwargs
        return inner

    def _fsdp_state_post_forward(self, fsdp_mod, original):
        def inner(*args, **kwargs):
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is fsdp_mod:
                self._ac_mod, self._in_ac = None, False
            self._fsdp_state = _FSDP.POST_FW
            return original(*args, **kwargs)
        return inner

    def _fsdp_param_group_pre_backward(self, fsdp_mod, original):
        def inner(*args, **kwargs):
            self._fsdp_state = _FSDP.PRE_BW
            original(*args, **kwargs)
            self._fsdp_state = _FSDP.BW
        return inner

    def _fsdp_param_group_post_backward(self, fsdp_mod, original):
        def inner(*args, **kwargs):
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            for p in group.fsdp_params if group else ():
                if p._unsharded_param.grad is not None:
                    self._update_and_maybe_create_winfos(p._unsharded_param.grad, Ref.UNSHARDED_GRAD)
            self._fsdp_state = _FSDP.POST_BW
            original(*args, **kwargs)
            for p in group.fsdp_params if group else ():
                if p.sharded_param.grad is not None:
                    self._update_and_maybe_create_winfos(p.sharded_param.grad, Ref.SHARDED_GRAD)
        return inner


_FSDP = fsdp2_mem_tracker._FSDPState


class Replay:
    """Calls repeated with the same shapes and no gradient (K denoising steps, every chunk's decode
    and text encoding) run once: a repeat books the first call's measured rise above where it
    ended, and allocates outputs of its shapes. A call runs again once what the first call left
    behind (autocast's cast weights, which live until its context ends) has been freed."""

    def __init__(self, tracker: "_Window"):
        self.tracker = tracker
        self.seen: dict = {}
        self.runs = self.replays = 0
        self.rises: dict[str, float] = {}
        """the largest measured rise of each wrapped call above where it ended, by name (bytes)"""

    def wrap(self, fn, graph_free: bool = False, name: str | None = None):
        """`fn` replayed when called without gradients (or always: `graph_free`, it builds no graph)."""
        name = name or getattr(fn, "__name__", "call")
        def call(*args, **kwargs):
            if torch.is_grad_enabled() and not graph_free:
                return fn(*args, **kwargs)
            key = (fn, _signature((args, kwargs)), torch.is_autocast_enabled("cpu"),
                   torch.get_autocast_dtype("cpu"))
            seen = self.seen.get(key)
            if seen is not None and all(r() is not None for r in seen[2]):
                self.replays += 1
                self.tracker.bump(seen[0])
                return _materialize(seen[1])
            self.runs += 1
            with self.tracker.excursion() as measured:
                out = fn(*args, **kwargs)
            outputs = {id(t.untyped_storage()) for t in _leaves(out)}
            left = [r for r in measured["made"] if r() is not None and id(r()) not in outputs]
            self.seen[key] = (measured["above"], _template(out), left)
            self.rises[name] = max(self.rises.get(name, 0.0), float(measured["above"].get("Total", 0)))
            return out
        return call


def _leaves(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, dict):
        obj = list(obj.values())
    return [t for v in obj for t in _leaves(v)] if isinstance(obj, (list, tuple)) else []


def _signature(obj):
    """What decides a call's memory: every tensor's shape and dtype, other values (a string by its
    length: prompts tokenize to their length)."""
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), obj.dtype, obj.requires_grad)
    if isinstance(obj, str):
        return ("S", len(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__, _signature([getattr(obj, f.name) for f in dataclasses.fields(obj)]))
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(v) for v in obj)
    return obj if isinstance(obj, (int, float, bool, type(None))) else type(obj).__name__


def _template(obj):
    if isinstance(obj, torch.Tensor):
        constant = obj.constant.clone() if isinstance(obj, FakeTensor) and obj.constant is not None else None
        return ("T", tuple(obj.shape), obj.dtype, constant)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return ("D", obj, {f.name: _template(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    if isinstance(obj, dict):
        return ("M", {k: _template(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return ("L", type(obj), [_template(v) for v in obj])
    return ("V", obj)


def _materialize(template):
    kind = template[0]
    if kind == "T":
        _, shape, dtype, constant = template
        return constant.clone() if constant is not None else torch.empty(shape, dtype=dtype)
    if kind == "D":
        return dataclasses.replace(template[1], **{k: _materialize(v) for k, v in template[2].items()})
    if kind == "M":
        return {k: _materialize(v) for k, v in template[1].items()}
    if kind == "L":
        return template[1](_materialize(v) for v in template[2])
    return template[1]


__all__ = ["CATEGORIES", "FSDPTracker", "Ref", "Replay", "Tracker", "categories", "patched",
           "uncounted_propagation"]
