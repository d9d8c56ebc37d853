"""How the model is spread over the ranks: `strategy=ddp` (a whole replica per rank) or
`strategy=fsdp` (FSDP2: parameters, gradients and optimizer state sharded).

One small object per option, built from `strategy=<option>` by `_target_`. The loop asks it
four things: wrap the model, accumulate without synchronising, agree on a per-step flag that
only one rank's shard may raise, and hand out the states a checkpoint saves. Those states
give whole tensors under the bare model's keys (FSDP gathers them to rank 0, and slices them
again on load) for a one-file checkpoint, or each rank's own shards for a sharded one
(checkpoint.format); either loads on any number of ranks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.checkpoint import checkpoint

from framework.components.meta_init import MetaUnsupported, Recipe, build_on_meta, materialize
from framework.core.distributed import wrap_ddp
from framework.core.exits import ConfigError
from framework.core.heap import give_back_freed_heap
from framework.core.launch_context import DistEnv
from framework.core.versions import reduce_fsdp_gradients_by_sum
from framework.storage.sharded import ShardedState

log = logging.getLogger("framework")

# block_classes=null: what each shipped model is sharded by (its repeated blocks).
DEFAULT_BLOCKS: dict[str, tuple[str, ...]] = {
    "GPT": ("TransformerBlock",),
    "ResNet": ("BasicBlock", "Bottleneck"),
}
# Optimizers whose fused kernel cannot take sharded (DTensor) parameters.
NO_FUSED = {"torch.optim.SGD"}
# Whole tensors on every rank (each takes its shard); strict as nn.Module.load_state_dict.
SCATTERED = StateDictOptions(full_state_dict=True, strict=True)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor: a view, written through in place."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class DDP:
    """Every rank holds the whole model; DDP all-reduces the gradients (dist.ddp.*)."""

    name = "ddp"
    shards = False  # parameters (and their gradients) are whole on every rank

    def __init__(self, activation_checkpointing: bool) -> None:
        self.activation_checkpointing = activation_checkpointing

    def checkpoint_activations(self, module: nn.Module) -> None:
        """strategy.activation_checkpointing: each block of the model keeps only its input for
        backward and runs its forward again there (the same values: the RNG state is replayed)."""
        if not self.activation_checkpointing:
            return
        names = self.block_names(module)
        found = blocks(module, names)
        if not found:
            raise ConfigError(
                f"strategy.activation_checkpointing=true: {type(module).__name__} has no blocks "
                f"to checkpoint (known: {', '.join(sorted(DEFAULT_BLOCKS))}); under "
                "strategy=fsdp name them with strategy.block_classes, or set it to false"
            )
        for block in found:
            block.forward = functools.partial(checkpointed, block.forward)
        log.info(
            "strategy.activation_checkpointing: %d block(s) of %s recompute their forward in "
            "backward",
            len(found),
            ", ".join(names),
        )

    def block_names(self, module: nn.Module) -> tuple[str, ...]:
        """The classes of `module`'s repeated blocks: what is sharded, or checkpointed."""
        return default_blocks(module)

    def build(
        self, new_module: Callable[[], nn.Module], env: DistEnv
    ) -> tuple[nn.Module, Recipe | None]:
        """The model, whole on this rank (and no recipe: its values are already there)."""
        return new_module(), None

    def materialize(self, recipe: Recipe, modules: list[nn.Module], device: torch.device) -> None:
        """Give a model that `build` made on the meta device (and `wrap` sharded) its values."""

    def wrap(
        self,
        module: nn.Module,
        ema_module: nn.Module | None,
        env: DistEnv,
        device: torch.device,
        ddp_options: Mapping[str, Any],
        param_dtype: torch.dtype | None = None,
    ) -> nn.Module:
        """What forward and backward run on (the bare module on one rank)."""
        self.checkpoint_activations(module)
        return wrap_ddp(module, device, ddp_options) if env.distributed else module

    def wire_bytes(self, module: nn.Module, micro_batches: int) -> dict[str, int] | None:
        """What a training step moves, when it is not DDP's gradient all-reduce (comm.py)."""
        return None

    def gather_around(self, module: nn.Module, methods: Iterable[str]) -> None:
        """Let `module`'s methods besides forward (a VAE's decode) run on it as forward does:
        whole parameters are on every rank, nothing to do."""

    def no_sync(self, train: nn.Module, module: nn.Module) -> contextlib.AbstractContextManager:
        """Backward accumulates gradients locally: no communication until the last
        micro-batch."""
        return train.no_sync()

    def agree(self, flag: torch.Tensor) -> torch.Tensor:
        """A flag every rank must act on alike (gradients found non-finite): DDP's gradients
        are identical on every rank, so each rank's own answer already is everyone's."""
        return flag

    def optimizer_overrides(self, optimizer_cfg: Mapping[str, Any]) -> dict[str, Any]:
        """Optimizer keywords this strategy cannot run as configured, and what it runs instead."""
        return {}

    def model_state(self, module: nn.Module) -> Any:
        """The Stateful a checkpoint saves a module's weights through."""
        return WholeModule(module)

    def optimizer_state(self, module: nn.Module, optimizer: Optimizer) -> Any:
        return WholeOptimizer(module, optimizer)

    def load_weights(
        self, module: nn.Module, state: Mapping[str, torch.Tensor] | ShardedState
    ) -> None:
        """A checkpoint's weights (whole tensors, or a sharded checkpoint's) into the module.
        Collective when ranks are."""
        self.model_state(module).load_state_dict(state)

    def load_initial(self, module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
        """The weights a run starts from (init=file), whole tensors on every rank: the keys
        given, every other key left as built (initial_weights.py checked which may be)."""
        self.model_state(module).load_state_dict(tensors, strict=False)


class FSDP(DDP):
    """FSDP2: `fully_shard` on each block, then on the root, over a 1-D mesh of every rank.
    Gradients are reduce-scattered (averaged, as DDP's are); with precision=bf16 parameters
    are gathered and gradients reduced in bfloat16 while the optimizer keeps fp32 shards."""

    name = "fsdp"

    def __init__(
        self,
        block_classes: list[str] | None,
        reshard_after_forward: bool,
        activation_checkpointing: bool,
    ) -> None:
        super().__init__(activation_checkpointing)
        self.block_classes = None if block_classes is None else list(block_classes)
        self.reshard_after_forward = reshard_after_forward
        self.shards = False  # until wrap() shards: one rank trains the whole model
        self.gathered_dtype: torch.dtype | None = None  # what parameters are gathered in

    def build(
        self, new_module: Callable[[], nn.Module], env: DistEnv
    ) -> tuple[nn.Module, Recipe | None]:
        """On several ranks, the model on the meta device (no rank ever holds it whole) and the
        recipe of a whole build's values. A model whose constructor cannot run there is refused
        in one line naming the module and why: building it whole on every rank would defeat
        the reason to shard it."""
        if not env.distributed:
            return new_module(), None
        if give_back_freed_heap():
            log.info("strategy=fsdp: freed memory goes back to the OS (glibc's thresholds)")
        try:
            return build_on_meta(new_module)
        except MetaUnsupported as error:
            raise ConfigError(
                f"strategy=fsdp: {error.module} cannot be built on the meta device "
                f"({error.reason}), so no rank could build only its shards; make its "
                "constructor use only tensor operations (no .item(), no other device), or use "
                "strategy=ddp"
            ) from error

    def materialize(self, recipe: Recipe, modules: list[nn.Module], device: torch.device) -> None:
        """Room for each rank's own shards only, then the values a whole build gives them
        (same generator, same order: the same initial weights as strategy=ddp)."""
        for module in modules:
            module.to_empty(device=device)
        held = materialize(recipe, modules)
        log.info(
            "strategy=fsdp: built on the meta device; each rank initialised only its shards "
            "(at most %.1f MiB of whole tensors held at once)",
            held / 2**20,
        )

    def wrap(
        self,
        module: nn.Module,
        ema_module: nn.Module | None,
        env: DistEnv,
        device: torch.device,
        ddp_options: Mapping[str, Any],
        param_dtype: torch.dtype | None = None,
    ) -> nn.Module:
        self.checkpoint_activations(module)  # (the EMA runs no backward)
        names = self.block_names(module)  # a name that is not there is refused on one rank too
        if not env.distributed:
            log.warning("strategy=fsdp with world_size=1: nothing to shard, the model trains whole")
            return module
        mesh = init_device_mesh(device.type, (env.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype)
        units = len(blocks(module, names))
        # The EMA is sharded alike: its update then works on matching local shards.
        for target in (module, ema_module) if ema_module is not None else (module,):
            for block in blocks(target, names):
                fully_shard(
                    block,
                    mesh=mesh,
                    reshard_after_forward=self.reshard_after_forward,
                    mp_policy=policy,
                )
            fully_shard(
                target,
                mesh=mesh,
                reshard_after_forward=self.reshard_after_forward,
                mp_policy=policy,
            )
            reduce_fsdp_gradients_by_sum(target)
        self.shards = True
        self.gathered_dtype = param_dtype
        log.info(
            "strategy=fsdp: %d block(s) of %s, then the root, sharded over %d ranks",
            units,
            ", ".join(names) or "(none)",
            env.world_size,
        )
        return module

    def block_names(self, module: nn.Module) -> tuple[str, ...]:
        if self.block_classes is None:
            return default_blocks(module)
        present = {qualified for sub in module.modules() for qualified in class_names(sub)}
        unknown = [name for name in self.block_classes if name not in present]
        if unknown:
            shown = sorted({type(sub).__name__ for sub in module.modules()})
            raise ConfigError(
                f"strategy.block_classes: {', '.join(unknown)} is no module class of "
                f"{type(module).__name__} (its classes: {', '.join(shown[:12])}); name one of "
                "them, or null for the model's default"
            )
        return tuple(self.block_classes)

    def wire_bytes(self, module: nn.Module, micro_batches: int) -> dict[str, int] | None:
        """Bytes FSDP2's collectives move in one optimizer step, counted as DDP's are (each
        collective's whole unsharded buffer): per unit, every micro-batch all-gathers its padded
        shards (N x ceil(rows / N) rows of each parameter) for forward, and a block resharded
        after forward once more for backward; the last micro-batch reduce-scatters the
        gradients of the same size."""
        if not self.shards:
            return None
        gathers = micro_batches * (2 if self.reshard_after_forward else 1)
        gathered = scattered = 0
        for parameter in module.parameters():  # each in one unit's buffers
            padded = padded_numel(parameter) * (self.gathered_dtype or parameter.dtype).itemsize
            gathered += gathers * padded
            scattered += padded if parameter.requires_grad else 0
        return {"all_gather": gathered, "reduce_scatter": scattered}

    def gather_around(self, module: nn.Module, methods: Iterable[str]) -> None:
        """FSDP gathers a sharded module's parameters only around forward: each named method
        becomes a forward method for it (FSDP2's public hook; a collective, like forward).
        Called for the artifacts after training only: a forward that calls such a method
        (a VAE's forward calls decode) would reshard in the middle of a training step."""
        for name in methods:
            if hasattr(module, name):  # a no-op on a module that is not sharded
                register_fsdp_forward_method(module, name)

    def no_sync(self, train: nn.Module, module: nn.Module) -> contextlib.AbstractContextManager:
        if not self.shards:
            return contextlib.nullcontext()
        return _gradient_sync_off(module)

    def agree(self, flag: torch.Tensor) -> torch.Tensor:
        """Each rank checked only its own gradient shard: a non-finite value anywhere is
        every rank's (one scalar all-reduce)."""
        if self.shards:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def optimizer_overrides(self, optimizer_cfg: Mapping[str, Any]) -> dict[str, Any]:
        """torch 2.13's fused SGD kernel has no DTensor rule (AdamW's has): SGD runs its
        foreach kernels on the shards (non-finite steps are then skipped after a host read)."""
        if self.shards and optimizer_cfg.get("fused") and optimizer_cfg["_target_"] in NO_FUSED:
            log.info("strategy=fsdp: %s runs unfused on the shards", optimizer_cfg["_target_"])
            return {"fused": False}
        return {}

    # Also on one rank: the optimizer's state then keeps FSDP's form (keyed by parameter
    # name), so a checkpoint moves between one rank and several.
    def model_state(self, module: nn.Module) -> Any:
        return ShardedModule(module)

    def optimizer_state(self, module: nn.Module, optimizer: Optimizer) -> Any:
        return ShardedOptimizer(module, optimizer)


def gathered() -> StateDictOptions:
    """Whole tensors gathered to rank 0, on the host: what a checkpoint saves (one process
    has nothing to gather from)."""
    return StateDictOptions(full_state_dict=True, cpu_offload=dist.is_initialized())


def padded_numel(parameter: torch.Tensor) -> int:
    """Elements of a sharded parameter's all-gather output: FSDP2 pads its first dimension
    to a multiple of the ranks (each rank's shard is ceil(rows / N) rows)."""
    if not isinstance(parameter, DTensor) or parameter.dim() == 0:
        return parameter.numel()
    ranks = parameter.device_mesh.size()
    rows = -(-parameter.shape[0] // ranks) * ranks
    return parameter.numel() // max(parameter.shape[0], 1) * rows


def default_blocks(module: nn.Module) -> tuple[str, ...]:
    """The repeated blocks of a shipped model (or of a subclass of one)."""
    kinds = (kind.__name__ for kind in type(module).__mro__)
    return next((DEFAULT_BLOCKS[kind] for kind in kinds if kind in DEFAULT_BLOCKS), ())


def checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`forward` whose intermediate results are not kept for backward but recomputed there
    (torch.utils.checkpoint, non-reentrant: it works under DDP, FSDP2 and torch.compile)."""
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def class_names(module: nn.Module) -> tuple[str, str]:
    kind = type(module)
    return kind.__name__, f"{kind.__module__}.{kind.__qualname__}"


def blocks(module: nn.Module, names: Iterable[str]) -> list[nn.Module]:
    """The submodules whose class is one of `names` (outermost first; none inside another)."""
    wanted = set(names)
    found: list[nn.Module] = []
    inside: set[int] = set()  # ids of the modules under a block already found
    for sub in module.modules():
        if sub is not module and id(sub) not in inside and wanted & set(class_names(sub)):
            found.append(sub)
            inside.update(id(under) for under in sub.modules())
    return found


@contextlib.contextmanager
def _gradient_sync_off(module: nn.Module) -> Iterator[None]:
    assert isinstance(module, FSDPModule)
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


class WholeModule:
    """A replicated module's weights: state_dict() on rank 0 for a one-file checkpoint,
    shard_state_dict() on every rank for a sharded one (DCP writes a replicated tensor once)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def shard_state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: Mapping[str, Any] | ShardedState, strict: bool = True) -> None:
        if isinstance(state, ShardedState):  # read into the module's own tensors
            state = state.load(self.module.state_dict())
        self.module.load_state_dict(state, strict=strict)


class WholeOptimizer:
    """A replicated optimizer's state: its own state_dict() in a one-file checkpoint (keyed by
    parameter index), keyed by parameter name in a sharded one."""

    def __init__(self, module: nn.Module, optimizer: Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def shard_state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: Mapping[str, Any] | ShardedState) -> None:
        if isinstance(state, ShardedState):
            own = get_optimizer_state_dict(self.module, self.optimizer)  # allocates the state
            set_optimizer_state_dict(self.module, self.optimizer, state.load(own))
        else:
            self.optimizer.load_state_dict(state)


class ShardedModule:
    """A sharded module's weights: whole tensors gathered to rank 0, on the host (a collective:
    every rank calls it) for a one-file checkpoint, or each rank's shards (DTensors) for a
    sharded one; either loads back into any number of ranks' shards."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.module, options=gathered())

    def shard_state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.module)

    def load_state_dict(self, state: Mapping[str, Any] | ShardedState, strict: bool = True) -> None:
        if isinstance(state, ShardedState):
            own = state.load(get_model_state_dict(self.module))
            set_model_state_dict(self.module, own, options=StateDictOptions(strict=strict))
        else:
            options = StateDictOptions(full_state_dict=True, strict=strict)
            set_model_state_dict(self.module, dict(state), options=options)


class ShardedOptimizer:
    """The optimizer's state keyed by parameter name: whole tensors (collective, as above) or
    each rank's shards."""

    def __init__(self, module: nn.Module, optimizer: Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.module, self.optimizer, options=gathered())

    def shard_state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: Mapping[str, Any] | ShardedState) -> None:
        if isinstance(state, ShardedState):
            own = state.load(get_optimizer_state_dict(self.module, self.optimizer))
            set_optimizer_state_dict(self.module, self.optimizer, own)
        else:
            set_optimizer_state_dict(self.module, self.optimizer, dict(state), options=SCATTERED)
