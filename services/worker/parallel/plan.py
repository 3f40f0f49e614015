"""What every rank of a worker group does to start: its device, its share of the model, its memory plan."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.common.config import Config
from services.worker.parallel.group import DistGroup, Layout
from services.worker.parallel.sharding import attach_all_reduce
from services.worker.setup.build import LoadedModel, load_model, plan_memory
from services.worker.setup.loader import ModelLoadError
from services.worker.setup.memory import MemoryFigures

log = logging.getLogger(__name__)


def tensor_parallel_size(config: Config) -> int:
    return config.parallel.tensor_parallel_size if config.parallel is not None else 1


def pipeline_parallel_size(config: Config) -> int:
    return config.parallel.pipeline_parallel_size if config.parallel is not None else 1


def world_size(config: Config) -> int:
    return tensor_parallel_size(config) * pipeline_parallel_size(config)


def ranks_per_node(config: Config) -> int:
    return world_size(config) // (config.parallel.nnodes if config.parallel is not None else 1)


def layout_of(config: Config, rank: int) -> Layout:
    return Layout(rank, tensor_parallel_size(config), pipeline_parallel_size(config))


@dataclass(slots=True)
class RankPlan:
    """What every rank is told at start (picklable: it crosses to the spawned processes and the store)."""

    config: Config
    model_path: str  # resolved: the embedded default model's file, or what --model names
    size: int  # every rank of the group: tensor x pipeline parallel
    init_addr: str  # host:port of the rendezvous (rank 0's store)
    kv_cache_memory: int  # CPU: each rank's share of the cache budget (0 on CUDA)
    num_threads: int  # torch threads of each rank (0: torch's default)
    parent_pid: int  # the process whose death ends a rank (rank 0, or a node's worker-rank)
    layers: list[tuple[int, int]] | None = None  # each stage's [start, end), None with one stage

    @property
    def cuda(self) -> bool:
        return rank_device(self.config, 0).type == "cuda"

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.init_addr.rpartition(":")
        return host.strip("[]"), int(port)


def rank_device(config: Config, rank: int) -> torch.device:
    """cuda:(rank on its node) on CUDA (one device per rank), else the CPU. Raises ModelLoadError when devices
    are missing."""
    name = config.device.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cuda":
        return torch.device("cpu")
    count, local = torch.cuda.device_count(), ranks_per_node(config)
    if count < local:
        raise ModelLoadError(
            f"{describe(config)} puts {local} ranks on each node, one CUDA device each, but {count} are visible"
        )
    return torch.device("cuda", rank % local)


def describe(config: Config) -> str:
    """The flags that made this a worker group, as the user wrote them."""
    tp, pp = tensor_parallel_size(config), pipeline_parallel_size(config)
    parts = ([f"--tensor-parallel-size {tp}"] if tp > 1 else []) + (
        [f"--pipeline-parallel-size {pp}"] if pp > 1 else []
    )
    return " ".join(parts) or "--tensor-parallel-size 1"


def check_options(config: Config, size: int) -> None:
    """The options a model sharded ``size`` ways (or staged) does not take, refused with the reason. (int8
    shards: each rank quantizes its own rows, one scale per output channel of its columns.)"""
    if pipeline_parallel_size(config) > 1:
        check_stage_options(config)
    if size == 1:
        return
    if config.load.quantization == "gguf":
        raise ModelLoadError(
            f"--quantization gguf cannot be split over --tensor-parallel-size {size}: a GGUF block spans a row's"
            " inputs; use --quantization int8 or none"
        )
    if config.device.cpu_kernels == "native":
        raise ModelLoadError(
            f"--cpu-kernels native runs a whole unsharded layer per call; with --tensor-parallel-size {size}"
            " use --cpu-kernels auto or torch"
        )
    if config.cache.kv_tier_names:
        raise ModelLoadError(
            f"--kv-tiers moves whole blocks of one KV cache; with --tensor-parallel-size {size} each rank holds"
            " a share of the KV heads, which the tiers do not move yet: leave --kv-tiers empty"
        )


def check_stage_options(config: Config) -> None:
    pp = pipeline_parallel_size(config)
    if config.load.quantization == "gguf":
        raise ModelLoadError(
            f"--quantization gguf is not split into --pipeline-parallel-size {pp} stages yet; use int8 or none"
        )
    if config.device.cpu_kernels == "native":
        raise ModelLoadError(
            f"--cpu-kernels native runs the whole model per call; with --pipeline-parallel-size {pp}"
            " use --cpu-kernels auto or torch"
        )
    if config.lora is not None and config.lora.enable_lora:
        raise ModelLoadError(
            f"--enable-lora applies adapters on one model; it is not served with --pipeline-parallel-size {pp} yet"
        )
    if config.scheduler.speculative_config:
        raise ModelLoadError(
            f"--speculative-config verifies proposals on one model; it is not served with --pipeline-parallel-size"
            f" {pp} yet: leave one of them out"
        )
    if config.cache.kv_tier_names:
        raise ModelLoadError(
            f"--kv-tiers moves whole blocks of one KV cache; with --pipeline-parallel-size {pp} each stage holds"
            " its layers' share, which the tiers do not move yet: leave --kv-tiers empty"
        )


def load_rank(config: Config, plan_layers: list[tuple[int, int]] | None, model_path: str, rank: int,
              group: DistGroup | None) -> LoadedModel:  # fmt: skip
    """This rank's share of the model: its stage's layers, its row-parallel projections summed over ``group``."""
    layout = layout_of(config, rank)
    loaded = load_model(
        model_path,
        dtype=config.model.dtype,
        device=str(rank_device(config, rank)),
        attention_backend=config.device.attention_backend,
        # The native decode path runs whole layers in C, with no all-reduce in between: torch under TP.
        cpu_kernels=config.device.cpu_kernels if layout.size == 1 else "torch",
        load_format=config.load.load_format,
        quantization=config.load.quantization,
        tp_rank=layout.tp_rank,
        tp_size=layout.tp,
        layers=plan_layers[layout.stage] if plan_layers else None,
    )
    if group is not None and layout.tp > 1:
        attach_all_reduce(loaded.model, group.all_reduce)
    return loaded


def plan_rank(
    config: Config, loaded: LoadedModel, max_len: int, kv_cache_memory: int, group: DistGroup | None
) -> MemoryFigures:
    """This rank's memory plan with the block count every rank can hold (a collective: all ranks call it)."""
    c = config
    figures = plan_memory(
        loaded,
        block_size=c.cache.block_size,
        max_len=max_len,
        kv_cache_memory=kv_cache_memory,
        gpu_memory_utilization=c.cache.gpu_memory_utilization,
        max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
        max_num_seqs=c.scheduler.max_num_seqs,
        seed=c.model.seed,
    )
    if group is None:
        return figures
    num_blocks = group.min(figures.num_blocks)
    if num_blocks != figures.num_blocks:
        log.info("rank %d could hold %d blocks; the smallest rank holds %d", group.rank, figures.num_blocks, num_blocks)
    figures.num_blocks = num_blocks
    figures.kv_cache_bytes = num_blocks * loaded.block_bytes(c.cache.block_size)
    return figures
