"""Measuring the GPU memory of a rank's own code without a GPU (README, "Memory").

torch's memory trackers (`MemTracker`, and `FSDPMemTracker` over a fake process group) run the
real code on FakeTensors, which have shapes, dtypes and devices and no data: a rank of a released
model is "allocated" in seconds and nothing is. This is how torchtitan estimates a configuration's
peak (scripts/estimate/estimation.py up to 2025). A CPU-only torch needs more, each scoped
to a `FakeRun` (host memory: to lab/memory/measure.py's `fake_rank`) and undone after it:

- The fake tensors live on the "cpu" device and stand for the GPU's: on a CPU-only build, autograd
  aborts the process (a C++ terminate) as soon as a fake "cuda" tensor needs a gradient, and SDPA
  on fake "cuda" takes the math kernel (an L x L score matrix). On "cpu" SDPA picks the flash
  kernel, which saves what CUDA's flash kernel saves (the output and its logsumexp).
- CUDA's autocast: `models.autocast` is bf16 autocast on CUDA and nothing on a CPU. Within a run
  it is CPU autocast, with the ops whose CUDA policy differs (layer_norm, softmax, exp and the
  other fp32 ops, SDPA, the reductions) cast as CUDA casts them (aten/src/ATen/autocast_mode.cpp).
- Values: small tensors made from host data (sigmas, token ids, advantages, counts) carry their
  values (FakeTensorMode constants, up to CONSTANT_NUMEL elements), so the code's decisions on them
  are the real ones; a value read from a tensor that has none (a checksum, a gradient norm) reads 1,
  and the run counts such reads (`FakeRun.unknown_reads`).
- DTensor's sharding propagation runs ops on global-size fake tensors inside our mode; the
  trackers would book them (fused AdamW over a 4-way shard peaked at 5x the state). They are not
  counted.
- Host memory: a transformer loaded there (an FSDP2 trainer's, runtime/context.py) is on the meta
  device, never counted, and FSDP2's move of each unit to the device makes its fake tensors
  (`moved_to_device`, patched in by lab/memory/measure.py).
- peft's move of a new adapter to its base layer's dtype is left out, and Module.to leaves a module
  already on its device and dtype alone (torch would swap every fake parameter with itself, which a
  FakeTensor refuses; the adapters end float32 either way).
"""
from __future__ import annotations

import contextlib
import sys
import types
import warnings

import torch
import torch.distributed as dist

import models
from parallel import torchapi
from peft.tuners.tuners_utils import BaseTunerLayer
from lab.memory.trackers import FEATURE, patched, uncounted_propagation

# torch's private APIs the measurement runs on: a torch without one fails here, naming it.
fake_tensor, FakeTensor, FakeTensorMode, active_fake_mode, FakeStore, tree_flatten, tree_map_only = torchapi.require(
    FEATURE, "torch._subclasses.fake_tensor", "torch._subclasses.fake_tensor.FakeTensor",
    "torch._subclasses.fake_tensor.FakeTensorMode", "torch._guards.active_fake_mode",
    "torch.testing._internal.distributed.fake_pg.FakeStore", "torch.utils._pytree.tree_flatten",
    "torch.utils._pytree.tree_map_only")
torchapi.require(FEATURE, "torch._subclasses.fake_tensor.unset_fake_temporarily",
                 "torch._subclasses.fake_tensor.CONSTANT_NUMEL_LIMIT", "torch._C._ExcludeDispatchKeyGuard",
                 "torch._C._nn._parse_to", "torch.library.Library._destroy", "torch.ops.aten.sum.default._schema")

GiB = 1024 ** 3
CONSTANT_NUMEL = 4096
"""Fake tensors of at most this many elements carry their values (torch's own limit is 1)."""


# ----- values ----------------------------------------------------------------------------------
_aten = torch.ops.aten
_KNOWN_VALUES = {_aten.zeros, _aten.ones, _aten.full, _aten.arange, _aten.linspace, _aten.scalar_tensor, _aten.eye,
                 _aten.zeros_like, _aten.ones_like, _aten.full_like, _aten.new_zeros, _aten.new_ones, _aten.new_full}
"""Ops whose values follow from their arguments' shapes alone: small results carry them."""


class MeasureMode(FakeTensorMode):
    """FakeTensorMode for a measurement: real tensors may enter (a small one keeps its values), and a
    value read from a tensor without one is 1 (or True) instead of an error."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.unknown_reads = 0
        converter = self.fake_tensor_converter
        from_real = converter.from_real_tensor

        def keep_small(mode, t, make_constant=False, **kw):
            small = t.numel() <= CONSTANT_NUMEL and t.device.type == "cpu" and not t.is_sparse
            return from_real(mode, t, make_constant=make_constant or small, **kw)

        converter.from_real_tensor = keep_small

    def dispatch(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            t = args[0]
            if isinstance(t, FakeTensor) and t.constant is None and t.item_memo is None:
                self.unknown_reads += 1
                return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        out = super().dispatch(func, types, args, kwargs)
        known = getattr(func, "overloadpacket", None) in _KNOWN_VALUES
        if known and isinstance(out, FakeTensor) and out.constant is None and out.numel() <= CONSTANT_NUMEL \
                and out.device.type == "cpu":
            with fake_tensor.unset_fake_temporarily():
                real_args, real_kwargs = tree_map_only(
                    FakeTensor, lambda t: torch.empty(t.shape, dtype=t.dtype), (args, kwargs or {}))
                value = func(*real_args, **real_kwargs)
            return self.fake_tensor_converter.from_real_tensor(self, value, make_constant=True)
        return out


# ----- CUDA autocast on the CPU ---------------------------------------------------------------
_LOW = ["einsum", "addmv", "addr", "mv", "chain_matmul", "linalg_multi_dot", "convolution", "_convolution",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "scaled_dot_product_attention"]
_FP32 = ["acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
         "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
         "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "cosine_similarity",
         "nll_loss", "nll_loss2d", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
         "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
         "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
         "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
         "upsample_trilinear3d", "upsample_bicubic2d"]
_FP32_OPT = ["prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
             "sum", "sum.dim_IntList"]
_PROMOTE = ["addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "index_put", "tensordot", "scatter_add"]
_POLICIES = {"low": _LOW, "fp32": _FP32, "fp32_opt": _FP32_OPT, "promote": _PROMOTE}
"""CUDA autocast's op lists where the CPU's differ (aten/src/ATen/autocast_mode.cpp, torch 2.13)."""


def _autocast_kernel(op, policy: str):
    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    half = (torch.float16, torch.bfloat16)

    def castable(t):
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == "cpu"

    def kernel(*args, **kwargs):
        if policy == "low":
            dt = torch.get_autocast_dtype("cpu")
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(dt) if castable(t) and t.dtype == torch.float32
                                         else t, (args, kwargs))
        elif policy == "fp32":
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.float() if castable(t) and t.dtype in half else t,
                                         (args, kwargs))
        elif policy == "fp32_opt":
            names = [a.name for a in op._schema.arguments]
            if castable(args[0]) and args[0].dtype in half and "dtype" in names and kwargs.get("dtype") is None:
                if len(args) <= names.index("dtype"):
                    kwargs = {**kwargs, "dtype": torch.float32}
                elif args[names.index("dtype")] is None:
                    args = (*args[:names.index("dtype")], torch.float32, *args[names.index("dtype") + 1:])
        else:  # promote: the widest floating dtype among the inputs
            dts = {t.dtype for t in tree_flatten((args, kwargs))[0] if castable(t)}
            widest = torch.float64 if torch.float64 in dts else torch.float32 if torch.float32 in dts else None
            if widest is not None:
                args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(widest) if castable(t) else t,
                                             (args, kwargs))
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(*args, **kwargs)
    return kernel


@contextlib.contextmanager
def cuda_autocast_policy():
    """CPU autocast casts as CUDA autocast does, within the block (kernels on AutocastCPU)."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        for policy, names in _POLICIES.items():
            for name in names:
                op_name, _, overload = name.partition(".")
                packet = getattr(torch.ops.aten, op_name, None)
                op = getattr(packet, overload or "default", None) if packet is not None else None
                if op is not None:
                    lib.impl(name, _autocast_kernel(op, policy), "AutocastCPU")
    try:
        yield
    finally:
        lib._destroy()


_AUTOCAST = models.autocast  # as imported, before any FakeRun replaces it


def gpu_autocast(device: torch.device, dtype_name: str, original=None):
    """`models.autocast` as a CUDA device would decide it (its dtype, its cache), on the fake device."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available, disabling autocast": only its settings are read
        decided = (original or _AUTOCAST)(torch.device("cuda"), dtype_name)
    if not isinstance(decided, torch.autocast):
        return decided
    return torch.autocast(device.type, dtype=decided.fast_dtype,
                          cache_enabled=torchapi.attribute(decided, "_cache_enabled", FEATURE))


# ----- a run ------------------------------------------------------------------------------------
class FakeRun(contextlib.ExitStack):
    """The scope of one measurement: a MeasureMode, CUDA autocast on the CPU, uncounted DTensor
    propagation, torch's FakeTensor constants up to CONSTANT_NUMEL elements, and the decisions
    `models` makes by device type (autocast, the dtype of each component) taken as for a CUDA
    device wherever a module imported them. Tensors made inside are fake."""

    def __enter__(self) -> "FakeRun":
        super().__enter__()
        try:
            self._enter()
        except BaseException:
            self.close()  # a run that fails part-way leaves nothing patched (the autocast kernels above all)
            raise
        return self

    def _enter(self) -> None:
        self.mode = MeasureMode()
        self.enter_context(patched(fake_tensor, "CONSTANT_NUMEL_LIMIT", CONSTANT_NUMEL))
        self.enter_context(cuda_autocast_policy())
        self.enter_context(uncounted_propagation())
        cuda = torch.device("cuda")
        originals = {name: getattr(models, name) for name in ("autocast", "model_dtypes", "resolve_dtype")}
        as_on_gpu = {"autocast": lambda device, name, f=originals["autocast"]: gpu_autocast(device, name, f),
                     "model_dtypes": lambda name, device, *a, f=originals["model_dtypes"], **k: f(name, cuda, *a, **k),
                     "resolve_dtype": lambda name, device, f=originals["resolve_dtype"]: f(name, cuda)}
        for module in list(sys.modules.values()):
            # The module's own dict, never getattr: a lazy module (transformers') imports on a missing
            # attribute, and what it would import may be absent (torchvision) or slow.
            namespace = vars(module) if isinstance(module, types.ModuleType) else {}
            for name, replacement in as_on_gpu.items():
                if namespace.get(name) is originals[name]:
                    self.enter_context(patched(module, name, replacement))
        # peft moves a new adapter to its base layer's device and dtype with Module.to, which must swap a
        # fake parameter and cannot (FakeTensorMode keeps weak references to it); models.lora makes
        # the adapters float32 on any base right after, so they stay as made (float32, on the device).
        self.enter_context(patched(BaseTunerLayer, "_move_adapter_to_device_of_base_layer",
                                   lambda layer, *a, **k: None))
        self.enter_context(patched(torch.nn.Module, "to", _to_unless_in_place(torch.nn.Module.to)))
        self.enter_context(self.mode)

    @property
    def unknown_reads(self) -> int:
        return self.mode.unknown_reads


def _to_unless_in_place(to):
    """Module.to for fake modules: one whose tensors already have the device and dtype asked for is
    left as it is, another gets fresh fake tensors of them (Module._apply would swap every fake
    parameter with its converted copy, which FakeTensors refuse: the mode keeps weak references)."""
    def module_to(module, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if all((device is None or t.device.type == torch.device(device).type)
               and (dtype is None or not t.is_floating_point() or t.dtype == dtype) for t in tensors):
            return module
        if tensors and all(isinstance(t, FakeTensor) for t in tensors):
            return _refake(module, tensors[0].fake_mode, dtype)
        return to(module, *args, **kwargs)
    return module_to


def _refake(module: torch.nn.Module, mode: FakeTensorMode, dtype: torch.dtype | None) -> torch.nn.Module:
    """A fake module's floating tensors as new fake tensors in `dtype`, ties and requires_grad kept."""
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in list(table.items()):
                if t is None or dtype is None or not t.is_floating_point() or t.dtype == dtype:
                    continue
                if id(t) not in made:
                    with contextlib.nullcontext() if active_fake_mode() is mode else mode:
                        new = torch.empty(t.shape, dtype=dtype, device=t.device)
                    made[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else new
                table[name] = made[id(t)]
    return module


def fake_module(module: torch.nn.Module, mode: FakeTensorMode, dtype: torch.dtype | None = None,
                meta_only: bool = False) -> torch.nn.Module:
    """Replace every parameter and buffer of a meta-device module (`meta_only`: those on the meta
    device, of a module that holds others), in place, by a fake tensor of its shape on "cpu" (floating
    ones in `dtype`), keeping tied tensors tied. (`to_empty` under the mode fails on torch 2.13: a meta
    module is not fake, and swapping fake parameters trips on their weakrefs.)"""
    made: dict[int, torch.Tensor] = {}

    def make(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in made:
            dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
            with contextlib.nullcontext() if active_fake_mode() is mode else mode:
                new = torch.empty(t.shape, dtype=dt, device="cpu")
            made[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if param else new
        return made[id(t)]

    def wanted(t: torch.Tensor | None) -> bool:
        return t is not None and (not meta_only or t.device.type == "meta")

    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if wanted(p):
                sub._parameters[name] = make(p, True)
        for name, b in list(sub._buffers.items()):
            if wanted(b):
                sub._buffers[name] = make(b, False)
    return module


def moved_to_device(fully_shard, mode: FakeTensorMode):
    """`fully_shard` as it meets a module in host memory (runtime/context.py `shards_from_host`): it
    moves the module's tensors to the mesh's device, then shards them, so the device holds the unit
    whole until its shards are made. In a measurement the host copy is on the meta device (never
    counted), and the move makes fake tensors of it."""
    def shard(module: torch.nn.Module, **kwargs):
        fake_module(module, mode, meta_only=True)
        return fully_shard(module, **kwargs)
    return shard


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """A fake process group of `world_size` ranks seen from `rank`: collectives return at once."""
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()



__all__ = ["CONSTANT_NUMEL", "FakeRun", "GiB", "MeasureMode", "cuda_autocast_policy", "fake_module", "fake_world",
           "gpu_autocast", "moved_to_device"]
