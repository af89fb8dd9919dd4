"""megatron-core on CPU: redirects the CUDA calls it hard-codes, so its models, tensor and pipeline parallelism
and schedules run over gloo on a machine without a GPU (this project's CI, a laptop).

Pinned to megatron-core MEGATRON_CORE_VERSION: `install()` refuses any other version, and
tests/trainer/test_megatron_cpu.py fails loudly when an upgrade breaks a redirection (each is checked by
name). With CUDA present nothing is patched: megatron runs as it was written.

What is redirected, and why each is safe on CPU (one process = one CPU "device"):
- `torch.cuda.current_device()` -> the CPU device. megatron passes it as `device=` to tensors it allocates
  (rotary frequencies, schedule buffers, p2p receive buffers) and to `.to()`.
- `torch.cuda.get_rng_state / set_rng_state / manual_seed` and megatron's own `_get_cuda_rng_state /
  _set_cuda_rng_state` -> the CPU generator's. The model-parallel RNG tracker
  (`model_parallel_cuda_manual_seed`) forks named RNG states for dropout and initialisation regions; on CPU
  they fork the CPU generator instead.
- `torch.cuda.synchronize`, `torch.cuda.empty_cache` -> no-ops: CPU work is synchronous.
- `Tensor.type()` (no argument) of a CPU float tensor -> its CUDA name ('torch.cuda.FloatTensor'): megatron's
  optimizers sort parameters into precision groups by those names and refuse any other. In the trainer
  process only, where nothing else asks.
- `Tensor.cuda()` -> the tensor itself (the distributed optimizer's state gather for checkpoints).
- `DistributedOptimizer._set_main_param_and_optimizer_states`, loading saved optimizer state: with
  torch's Adam (megatron's optimizer when Apex and TransformerEngine are absent, always on CPU) the state
  has a per-parameter `step` that the checkpoint keeps in its param groups instead; load_state_dict has
  already put it back, so the setter is handed that same tensor rather than failing on the missing key.
- `torch.cuda.device_count()` -> 1, `torch.cuda.is_available` is left False (megatron checks it to choose
  code paths that need no CUDA).
- `device="cuda"` written into tensor factories (the schedules' token counters, the default causal masks,
  tensor-parallel data broadcast, the optimizers' overflow flags and loss scale, gradient clipping's norms,
  the DDP buffers' warm-up tensor, megatron.core.utils' multi-tensor norms): in the modules of
  DEVICE_MODULES, the module's global `torch` becomes a proxy whose factories (`zeros`, `ones`, `empty`, `full`, `tensor`, `arange`) allocate on the CPU when
  asked for CUDA; everything else is torch itself.
"""

from __future__ import annotations

import torch

MEGATRON_CORE_VERSION = "0.16.1"
_installed = False


def _cpu_device(*_args, **_kwargs) -> torch.device:
    return torch.device("cpu")


def _cpu_get_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.set_rng_state(state)


def _cpu_manual_seed(seed: int, *_args, **_kwargs) -> None:
    torch.manual_seed(seed)


def _nothing(*_args, **_kwargs) -> None:
    return None


def _one(*_args, **_kwargs) -> int:
    return 1


# (module path, attribute) -> its CPU replacement
REDIRECTS = {
    ("torch.cuda", "current_device"): _cpu_device,
    ("torch.cuda", "get_rng_state"): _cpu_get_rng_state,
    ("torch.cuda", "set_rng_state"): _cpu_set_rng_state,
    ("torch.cuda", "manual_seed"): _cpu_manual_seed,
    ("torch.cuda", "synchronize"): _nothing,
    ("torch.cuda", "empty_cache"): _nothing,
    ("torch.cuda", "device_count"): _one,
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): _cpu_get_rng_state,
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): _cpu_set_rng_state,
}


DEVICE_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
)
FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")


def _on_cpu(device):
    return "cpu" if device is not None and torch.device(device).type == "cuda" else device


_tensor_type = torch.Tensor.type
FLOAT_TYPES = ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor")


def _type_as_cuda(self, dtype=None, non_blocking=False, **kwargs):
    """Tensor.type() with no argument names a CPU float tensor as its CUDA twin ('torch.cuda.FloatTensor'):
    megatron's optimizers accept parameters by those names only."""
    if dtype is None and not kwargs:
        name = _tensor_type(self)
        return name.replace("torch.", "torch.cuda.", 1) if name in FLOAT_TYPES else name
    return _tensor_type(self, dtype, non_blocking, **kwargs)


def _stays_on_cpu(self, *_args, **_kwargs):
    """Tensor.cuda() -> the tensor itself (the distributed optimizer moves state it gathers 'to the GPU')."""
    return self


class _TorchOnCPU:
    """`torch` as a module of DEVICE_MODULES sees it: factories asked for CUDA allocate on the CPU."""

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name not in FACTORIES:
            return value

        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _on_cpu(kwargs["device"])
            return value(*args, **kwargs)

        return factory


def _patch_step_restore() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    name = "_set_main_param_and_optimizer_states"
    original = getattr(DistributedOptimizer, name, None)
    if original is None:
        raise RuntimeError(f"megatron CPU shim: DistributedOptimizer.{name} is gone")
    if getattr(original, "_sluice_shim", False):
        return

    def set_states(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state.get(main_param, {}).get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    set_states._sluice_shim = True  # type: ignore[attr-defined]  # marks the patch, against patching twice
    setattr(DistributedOptimizer, name, set_states)


def installed_version() -> str:
    from megatron.core import __version__

    return __version__


def install() -> bool:
    """Apply the redirections when there is no CUDA (idempotent); True if they are in place. Raises if the
    installed megatron-core is not the pinned version or a redirected name no longer exists in it."""
    global _installed
    import importlib

    version = installed_version()
    if version != MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"megatron-core {version} is installed; the CPU shim (services/trainer/megatron_cpu.py) "
            f"is written and tested for {MEGATRON_CORE_VERSION}: install that, or check the shim "
            "against the new version and move the pin"
        )
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    for (module_name, attr), replacement in REDIRECTS.items():
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise RuntimeError(f"megatron CPU shim: {module_name}.{attr} is gone in megatron-core {version}")
        setattr(module, attr, replacement)
    torch.Tensor.type = _type_as_cuda  # type: ignore[method-assign]  # the shim's purpose: patch torch on CPU
    _patch_step_restore()
    torch.Tensor.cuda = _stays_on_cpu  # type: ignore[method-assign]
    for module_name in DEVICE_MODULES:
        module = importlib.import_module(module_name)
        if getattr(module, "torch", None) is not torch:
            raise RuntimeError(f"megatron CPU shim: {module_name} no longer uses torch as a module global")
        module.torch = _TorchOnCPU()  # type: ignore[attr-defined]  # checked just above
    _installed = True
    return True
