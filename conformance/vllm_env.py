"""Build vLLM's real scheduler-side offloading connector on a CPU-only machine.

Everything is real: `VllmConfig` (with a tiny llama `config.json` and no weights,
`DeviceConfig(device="cpu")`), `KVCacheConfig`, vLLM's `OffloadingConnector` in the
SCHEDULER role, the CPU offloading spec and its `CPUOffloadingManager`, requests with vLLM's
block hasher, `SchedulerOutput` and `KVConnectorOutput` messages. Supported: vLLM 0.33.0 and
0.25.1 (between them the KV tensor description and several field names changed).

Importing this module prepares the environment (vLLM's cache and config roots in a temporary
folder, offline, no usage statistics, quiet logging) but does not import vLLM: that happens
on first use, and takes several seconds. Building a `ModelConfig` takes about ten more; it
is cached per process (per `max_model_len`), so `make_setup` is cheap after the first call.

    setup = make_setup(num_gpu_blocks=16, num_cpu_chunks=4)
    req = make_request(setup, "r0", list(range(32)))
    setup.connector.on_new_request(req)
    setup.connector.get_num_new_matched_tokens(req, 0)
    ...
    setup.connector.build_connector_meta(scheduler_output(setup, new={"r0": (req, [1, 2])},
                                                          num_scheduled_tokens={"r0": 32}))
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from conformance import releases

# ----------------------------------------------------------------------------- environment
_TMP = Path(tempfile.mkdtemp(prefix="kvspec-vllm-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)


def _prepare_environment() -> None:
    """Keep vLLM's files in a temporary folder, stay offline and quiet (done once)."""
    os.environ["VLLM_CACHE_ROOT"] = str(_TMP / "cache")
    os.environ["VLLM_CONFIG_ROOT"] = str(_TMP / "config")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["VLLM_NO_USAGE_STATS"] = "1"
    os.environ["DO_NOT_TRACK"] = "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("vllm", "torch", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


_prepare_environment()

NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 16
EOS_TOKEN_ID = 2
VOCAB_SIZE = 32000


def _model_dir() -> Path:
    """A tiny llama `config.json` (no weights, no tokenizer): enough for ModelConfig."""
    path = _TMP / "tiny-llama"
    if not (path / "config.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": NUM_KV_HEADS * HEAD_SIZE * 2,
            "intermediate_size": 128,
            "num_attention_heads": NUM_KV_HEADS * 2,
            "num_key_value_heads": NUM_KV_HEADS,
            "num_hidden_layers": NUM_LAYERS,
            "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": 1 << 16,
            "rms_norm_eps": 1e-5,
            "torch_dtype": "float32",
            "bos_token_id": 1,
            "eos_token_id": EOS_TOKEN_ID,
        }))
    return path


# ----------------------------------------------------------------------------- vLLM, lazily
_OFFLOAD = "vllm.distributed.kv_transfer.kv_connector.v1"


@cache
def _v() -> SimpleNamespace:
    """vLLM's classes (imported on first use; about 8 s)."""

    def mod(name: str) -> Any:
        return importlib.import_module(name)

    vllm = mod("vllm")
    config = mod("vllm.config")
    kv_utils = mod("vllm.v1.core.kv_cache_utils")
    hashing = mod("vllm.utils.hashing")
    kv_iface = mod("vllm.v1.kv_cache_interface")
    output = mod("vllm.v1.core.sched.output")
    kv_utils.init_none_hash(hashing.sha256)
    return SimpleNamespace(
        vllm=vllm,
        version=vllm.__version__,
        file=vllm.__file__,
        torch=mod("torch"),
        config=config,
        SamplingParams=vllm.SamplingParams,
        KVConnectorRole=mod(_OFFLOAD).KVConnectorRole,
        OffloadingConnector=mod(f"{_OFFLOAD}.offloading_connector").OffloadingConnector,
        OffloadingWorkerMetadata=mod(f"{_OFFLOAD}.offloading.common").OffloadingWorkerMetadata,
        sha256=hashing.sha256,
        KVCacheBlocks=mod("vllm.v1.core.kv_cache_manager").KVCacheBlocks,
        KVCacheBlock=kv_utils.KVCacheBlock,
        get_request_block_hasher=kv_utils.get_request_block_hasher,
        NewRequestData=output.NewRequestData,
        CachedRequestData=output.CachedRequestData,
        SchedulerOutput=output.SchedulerOutput,
        FullAttentionSpec=kv_iface.FullAttentionSpec,
        SlidingWindowSpec=kv_iface.SlidingWindowSpec,
        MambaSpec=kv_iface.MambaSpec,
        KVConnectorBlockState=getattr(output, "KVConnectorBlockState", None),
        KVCacheBlockCopy=getattr(kv_utils, "KVCacheBlockCopy", None),
        KVCacheConfig=kv_iface.KVCacheConfig,
        KVCacheGroupSpec=kv_iface.KVCacheGroupSpec,
        KVCacheTensor=kv_iface.KVCacheTensor,
        CPUOffloadingManager=mod("vllm.v1.kv_offload.cpu.manager").CPUOffloadingManager,
        CPUOffloadingSpec=mod("vllm.v1.kv_offload.cpu.spec").CPUOffloadingSpec,
        make_offload_key=mod("vllm.v1.kv_offload.base").make_offload_key,
        KVConnectorOutput=mod("vllm.v1.outputs").KVConnectorOutput,
        Request=mod("vllm.v1.request").Request,
        RequestStatus=mod("vllm.v1.request").RequestStatus,
    )


def scheduler_side_modules() -> SimpleNamespace:
    """Import every vLLM module the conformance code uses (scripts/vllm-venv.sh's check that
    a release's venv has the packages its scheduler side needs)."""
    return _v()


def _release_from_tree(origin: str | None) -> str | None:
    """The version a vLLM tree's `_version.py` (written when the wheel is built) names."""
    if not origin:
        return None
    path = Path(origin).parent / "_version.py"
    try:
        text = path.read_text()
    except OSError:
        return None
    found = re.search(r"""^(?:__version__|version)\s*(?::[^=]*)?=\s*['"]([^'"]+)['"]""",
                      text, re.MULTILINE)
    return found.group(1) if found else None


def _is_release(text: str) -> bool:
    return re.match(r"\d+\.\d+", text) is not None and releases.parse(text) > (0, 0, 0)


@cache
def release_version() -> tuple[int, int, int]:
    """The version of the vLLM the tests import, found WITHOUT importing it (the machines'
    bounds are chosen when `conformance.adapter` is imported): the `_version.py` of the tree
    first on the path (the installed wheel, or a VLLM_SRC tree), else the release the venv
    was built for (KVSPEC_VLLM_VERSION, as the Makefile sets it, or the installed
    distribution), else the newest supported release (vLLM not installed)."""
    spec = importlib.util.find_spec("vllm")
    candidates = [_release_from_tree(spec.origin if spec else None),
                  os.environ.get("KVSPEC_VLLM_VERSION")]
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        candidates.append(importlib.metadata.version("vllm"))
    for text in candidates:
        if text and _is_release(text):
            return releases.parse(text)
    return releases.RELEASES[-1].key


def vllm_version() -> tuple[int, int, int]:
    """The installed (or VLLM_SRC) vLLM's version, as (major, minor, patch) (imports vLLM). A
    source tree without a built version (`vllm.__version__` "dev") is taken for the release
    its venv holds (`release_version`)."""
    text = str(_v().version)
    return releases.parse(text) if _is_release(text) else release_version()


def has(feature: str) -> bool:
    """Whether the vLLM under test has `feature` (a key of `conformance.releases.FEATURES`:
    the first release with each scheduler-side difference the conformance code translates).
    Decided without importing vLLM."""
    return releases.has(feature, release_version())


def transfer_specs(job: Any) -> tuple[Any, Any]:
    """A metadata `TransferJob`'s (source, destination) specs: from 0.25.0 its `src_spec`
    and `dst_spec` (C@0.25.0:54-66), before the pair `transfer_spec` (C@0.22.0:15-25;
    feature transfer_job_fields)."""
    if has("transfer_job_fields"):
        return job.src_spec, job.dst_spec
    src, dst = job.transfer_spec
    return src, dst


def missing(*features: str) -> list[str]:
    """The `features` the vLLM under test lacks (a test skips naming them)."""
    return [f for f in features if not has(f)]


def vllm_file() -> str:
    """`vllm.__file__`: which tree is under test (an installed wheel or a VLLM_SRC checkout)."""
    return str(_v().file)


def has_reset_fence() -> bool:
    """0.33 tracks stale jobs' outstanding reports (`_reset_fence`); earlier releases do not
    (the adapter emulates the fence from the acks it delivers)."""
    return has("reset_fence")


@cache
def _model_config(max_model_len: int) -> Any:
    path = str(_model_dir())
    return _v().config.ModelConfig(model=path, tokenizer=path, skip_tokenizer_init=True,
                                   dtype="float32", max_model_len=max_model_len, seed=0)


# ----------------------------------------------------------------------------- the setup
@dataclass
class VLLMSetup:
    """One freshly built scheduler-side connector and what it was built from."""

    version: tuple[int, int, int]
    connector: Any
    """vLLM's `OffloadingConnector` (role SCHEDULER): the hooks the core scheduler calls."""
    scheduler: Any
    """`connector.connector_scheduler`: the `OffloadingConnectorScheduler` with the tables."""
    manager: Any
    """The `CPUOffloadingManager`."""
    block_size: int
    """Tokens per GPU block (= tokens per block hash)."""
    blocks_per_chunk: int
    num_gpu_blocks: int
    num_cpu_chunks: int
    num_workers: int
    eviction_policy: str
    vllm_config: Any
    kv_cache_config: Any
    block_hasher: Any
    vllm_file: str
    extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_chunk(self) -> int:
        return self.block_size * self.blocks_per_chunk


def _hybrid(sliding_window: int | None, groups: Sequence[str]) -> bool:
    """A group other than full attention (a sliding window or a Mamba group), whose kept
    blocks vLLM's prefix-cache retention interval decides."""
    return sliding_window is not None or "mamba" in groups


def model_groups(sliding_window: int | None, groups: Sequence[str]) -> tuple[str, ...]:
    """The model's KV cache groups, in order: `groups` where a sliding window or a Mamba
    group makes it more than one full-attention group."""
    return tuple(groups) if _hybrid(sliding_window, groups) else ("full",)


def model_layers(groups: Sequence[str]) -> list[list[str]]:
    """The layer names of each KV cache group of a model of the groups `groups`
    (`model_groups`): a model of one group (full attention, a pure Mamba model, a window
    on every layer) has its NUM_LAYERS layers in it, a hybrid model one layer per group,
    in order (two or three)."""
    count = NUM_LAYERS if len(groups) == 1 else len(groups)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(count)]
    return [names] if len(groups) == 1 else [[name] for name in names]


def chunk_layers(groups: Sequence[str]) -> int:
    """The layers one CPU chunk holds, in a model of the KV cache groups `groups`
    (`model_groups`): its group's where the KV tensors describe their layers (0.29+);
    before, the CPU spec sums every tensor per block (offloading/config.py:90-103 in
    0.26.0): all the layers."""
    per_group = model_layers(groups)
    return len(per_group[0]) if has("kv_tensor_layers") else sum(map(len, per_group))


def _kv_tensor(v: Any, size: int, layers: list[str], page: int, num_gpu_blocks: int) -> Any:
    """A `KVCacheTensor` backing `layers`: 0.29+ describes its layout (layer-outermost:
    `layers`, `layer_stride`, `block_stride`, vllm/v1/kv_cache_interface.py), earlier
    releases name the layers that share it (`shared_by`)."""
    if has("kv_tensor_layers"):
        return v.KVCacheTensor(size=size, layers=layers, layer_stride=page * num_gpu_blocks,
                               block_stride=page)
    return v.KVCacheTensor(size=size, shared_by=layers)


def _kv_cache_config(num_gpu_blocks: int, block_size: int,
                     sliding_window: int | None = None,
                     groups: Sequence[str] = ("full", "sliding")) -> Any:
    v = _v()
    kinds = model_groups(sliding_window, groups)
    per_group = model_layers(kinds)
    full = v.FullAttentionSpec(block_size=block_size, num_kv_heads=NUM_KV_HEADS,
                               head_size=HEAD_SIZE, dtype=v.torch.float32)
    page = full.page_size_bytes
    specs: dict[str, Any] = {"full": full}
    if "sliding" in kinds:
        specs["sliding"] = v.SlidingWindowSpec(
            block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
            dtype=v.torch.float32, sliding_window=sliding_window)
    if "mamba" in kinds:  # align mode (what prefix caching turns on); a state of one
        specs["mamba"] = v.MambaSpec(  # attention page, as vLLM pads it to
            block_size=block_size, shapes=((page // 4,),), dtypes=(v.torch.float32,),
            mamba_cache_mode="align")
    if len(kinds) > 1:  # a hybrid model: one layer per group, in order
        tensors = [_kv_tensor(v, page * num_gpu_blocks, layers, page, num_gpu_blocks)
                   for layers in per_group]
        return v.KVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=tensors,
                               kv_cache_groups=[v.KVCacheGroupSpec(layers, specs[kind])
                                                for layers, kind in zip(per_group, kinds,
                                                                        strict=True)])
    [layers] = per_group
    if has("kv_tensor_layers"):  # one backing allocation for all layers, layer-outermost
        tensors = [_kv_tensor(v, page * len(layers) * num_gpu_blocks, layers, page,
                              num_gpu_blocks)]
    else:  # one tensor per layer
        tensors = [_kv_tensor(v, page * num_gpu_blocks, [name], page, num_gpu_blocks)
                   for name in layers]
    return v.KVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=tensors,
                           kv_cache_groups=[v.KVCacheGroupSpec(layers, specs[kinds[0]])])


def _chunk_bytes(block_size: int, blocks_per_chunk: int, num_workers: int,
                 layers: int = NUM_LAYERS) -> int:
    """CPU bytes one chunk takes, as the CPU spec computes it (aligned): the pages of the
    `layers` of its group."""
    v = _v()
    spec = v.FullAttentionSpec(block_size=block_size, num_kv_heads=NUM_KV_HEADS,
                               head_size=HEAD_SIZE, dtype=v.torch.float32)
    raw = int(spec.page_size_bytes) * layers * num_workers * blocks_per_chunk
    align = int(getattr(v.CPUOffloadingSpec, "BLOCK_SIZE_ALIGNMENT", 1) or 1)
    return -(-raw // align) * align


def manager_num_chunks(manager: Any) -> int:
    for name in ("_num_chunks", "_num_blocks", "num_chunks", "num_blocks"):
        if hasattr(manager, name):
            return int(getattr(manager, name))
    raise AttributeError(f"cannot find the chunk count of {type(manager).__name__}")


def make_setup(*, num_gpu_blocks: int, block_size: int = 16, blocks_per_chunk: int = 1,
               cpu_bytes: int | None = None, num_cpu_chunks: int | None = None,
               eviction_policy: str = "lru", max_num_seqs: int = 16,
               max_model_len: int = 1024, num_workers: int = 1,
               enable_prefix_caching: bool = True,
               extra_config: Mapping[str, Any] | None = None,
               sliding_window: int | None = None,
               groups: Sequence[str] = ("full", "sliding"),
               prefix_match_unit: int | None = None,
               retention_interval: int | None = None) -> VLLMSetup:
    """A fresh scheduler-side connector over `num_gpu_blocks` GPU blocks (block 0 is vLLM's
    null block: never hand it to a request) and `num_cpu_chunks` CPU chunks (or `cpu_bytes`
    of CPU memory; default 64 MiB). `num_workers` is the world size (tensor-parallel ranks):
    every job then waits for that many acks. With `sliding_window` (tokens) or a Mamba group
    the model has the KV cache groups `groups` names, in order (`model_groups`; default a
    full-attention group, then a sliding window; `("mamba",)` is a pure Mamba model,
    `("sliding",)` a window on every layer), else one full-attention group;
    `retention_interval` is vLLM's `prefix_cache_retention_interval` (None, the default
    here: every chunk's window tail is retained and offloaded; vLLM's own default is 0).
    `prefix_match_unit` (tokens, dividing `block_size`) hashes requests finer than a block:
    with a Mamba group, vLLM's partial tails are on."""
    v = _v()
    version = vllm_version()
    if num_cpu_chunks is not None:
        if cpu_bytes is not None:
            raise ValueError("give cpu_bytes or num_cpu_chunks, not both")
        layers = chunk_layers(model_groups(sliding_window, groups))
        cpu_bytes = num_cpu_chunks * _chunk_bytes(block_size, blocks_per_chunk, num_workers,
                                                  layers)
    if cpu_bytes is None:
        cpu_bytes = 64 << 20
    extra: dict[str, Any] = {
        "spec_name": "CPUOffloadingSpec",
        "cpu_bytes_to_use": cpu_bytes,
        "eviction_policy": eviction_policy,
    }
    if has("offload_caps"):  # the connector's setting since 0.23.0 (0.22 stores everything)
        extra["offload_prompt_only"] = False
    if blocks_per_chunk != 1:  # understood by both versions ("blocks_per_chunk" is 0.33 only)
        extra["block_size"] = block_size * blocks_per_chunk
    extra.update(extra_config or {})
    cfg = v.config
    # None: a sliding-window group keeps (and stores) every chunk's window tail; vLLM's
    # default (0) keeps only the tail a replay of the prompt reads
    dense = ({"prefix_cache_retention_interval": retention_interval}
             if _hybrid(sliding_window, groups) and has("retention_interval") else {})
    if retention_interval is not None and not has("retention_interval"):
        raise RuntimeError("a retention interval needs the feature retention_interval "
                           f"(vLLM {releases.FEATURES['retention_interval']}+)")
    # a hash finer than a block (0.26+; 0.25.1's CacheConfig has no such field)
    if prefix_match_unit and not has("prefix_match_unit"):
        raise RuntimeError("a hash finer than a block needs the feature prefix_match_unit "
                           f"(vLLM {releases.FEATURES['prefix_match_unit']}+)")
    hashing = {"prefix_match_unit": prefix_match_unit} if prefix_match_unit else {}
    parallel = (cfg.ParallelConfig(tensor_parallel_size=num_workers) if num_workers > 1
                else cfg.ParallelConfig())
    vllm_config = cfg.VllmConfig(
        model_config=_model_config(max_model_len),
        cache_config=cfg.CacheConfig(block_size=block_size, gpu_memory_utilization=0.9,
                                     cache_dtype="auto",
                                     enable_prefix_caching=enable_prefix_caching,
                                     **dense, **hashing),
        scheduler_config=cfg.SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max(max_model_len, 2048),
            max_model_len=max_model_len, enable_chunked_prefill=True,
            is_encoder_decoder=False),
        parallel_config=parallel,
        device_config=cfg.DeviceConfig(device="cpu"),
        kv_transfer_config=cfg.KVTransferConfig(kv_connector="OffloadingConnector",
                                                kv_role="kv_both",
                                                kv_connector_extra_config=extra),
    )
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    world = int(vllm_config.parallel_config.world_size)
    if world != num_workers:
        raise RuntimeError(f"asked for {num_workers} workers, vLLM's world size is {world}")
    kv_cache_config = _kv_cache_config(num_gpu_blocks, block_size, sliding_window, groups)
    connector = v.OffloadingConnector(vllm_config, v.KVConnectorRole.SCHEDULER,
                                      kv_cache_config)
    scheduler = connector.connector_scheduler
    manager = scheduler.manager
    if not isinstance(manager, v.CPUOffloadingManager):
        raise RuntimeError(f"expected a CPUOffloadingManager, got {type(manager).__name__}")
    chunks = manager_num_chunks(manager)
    if num_cpu_chunks is not None and chunks != num_cpu_chunks:
        raise RuntimeError(f"asked for {num_cpu_chunks} CPU chunks, vLLM made {chunks}")
    return VLLMSetup(
        version=version, connector=connector, scheduler=scheduler, manager=manager,
        block_size=block_size, blocks_per_chunk=blocks_per_chunk,
        num_gpu_blocks=num_gpu_blocks, num_cpu_chunks=chunks, num_workers=world,
        eviction_policy=eviction_policy, vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_hasher=v.get_request_block_hasher(prefix_match_unit or block_size, v.sha256),
        vllm_file=str(v.file), extra_config=extra,
    )


# ----------------------------------------------------------------------------- messages
def make_request(setup: VLLMSetup, req_id: str, prompt_token_ids: list[int],
                 max_tokens: int = 100, kv_transfer_params: dict[str, Any] | None = None,
                 skip_reading_prefix_cache: bool = False) -> Any:
    """A real vLLM `Request` with the block hasher (its `block_hashes` cover every full
    block of the prompt), and the request's own offloading settings: `kv_transfer_params`
    (through the sampling params' `extra_args`, vllm/v1/request.py:119-122) and
    `skip_reading_prefix_cache`. The caller calls `connector.on_new_request` itself."""
    v = _v()
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    params = v.SamplingParams(max_tokens=max_tokens, extra_args=extra,
                              skip_reading_prefix_cache=skip_reading_prefix_cache or None)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return v.Request(request_id=req_id, prompt_token_ids=list(prompt_token_ids),
                     sampling_params=params, pooling_params=None,
                     block_hasher=setup.block_hasher)


def offload_key(block_hash: Any, group: int = 0) -> Any:
    """The manager's key of the chunk ending at `block_hash` (one KV-cache group)."""
    return _v().make_offload_key(block_hash, group)


def request_status() -> Any:
    """vLLM's `RequestStatus` enum."""
    return _v().RequestStatus


def kv_blocks(block_ids: Sequence[Any]) -> Any:
    """`KVCacheBlocks` (what `update_state_after_alloc` receives): of one KV-cache group
    from a flat sequence of ids, or of several from one sequence per group."""
    v = _v()
    return v.KVCacheBlocks(tuple([_block(v, b) for b in g] for g in _groups(block_ids)))


def _block(v: Any, block_id: int) -> Any:
    """A `KVCacheBlock`; id 0 is vLLM's null block."""
    block = v.KVCacheBlock(int(block_id))
    if block_id == 0:
        block.is_null = True
    return block


class SortedIdSet(set[str]):
    """A set of request ids that iterates in sorted order.

    vLLM's core keeps `finished_req_ids` and `preempted_req_ids` in plain sets, so the
    connector visits them in string-hash order, which changes from process to process
    (PYTHONHASHSEED). Where the order matters (finished requests competing for the last CPU
    chunks in one step), a reproducible test needs one order: this set gives the sorted one,
    which is also the spec's (translation FINISHED-ORDER in CONFORMANCE.md)."""

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set.__iter__(self)))


def scheduler_output_of(setup: VLLMSetup, step: Any, requests: Mapping[str, Any],
                        handoffs: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
                        copies: Sequence[tuple[int, int]] = ()) -> Any:
    """vLLM's `SchedulerOutput` of a `statemachine.core.CoreStep` (the record every core
    stand-in builds), with vLLM's request objects from `requests`, the Mamba states the core
    hands off in the step (`(group, vLLM block id, boundary tokens)` per request) and the
    block copies it queued (`(source, destination)` vLLM block ids)."""
    return scheduler_output(
        setup, new={r: (requests[r], b) for r, b in step.new.items()},
        resumed={r: (requests[r], b) for r, b in step.cached.items() if r in step.resumed},
        cached={r: (requests[r], b) for r, b in step.cached.items() if r not in step.resumed},
        num_scheduled_tokens=step.num_scheduled, finished_req_ids=step.finished,
        preempted_req_ids=step.preempted, boundary_state_offloads=handoffs,
        kv_cache_block_copies=copies)


def _groups(blocks: Sequence[Any]) -> tuple[list[int], ...]:
    """Block ids per KV cache group: a flat sequence of ids is one group's; a sequence of
    sequences gives each group's (0 is vLLM's null block)."""
    if blocks and not isinstance(blocks[0], int):
        return tuple(list(map(int, g)) for g in blocks)
    return (list(map(int, blocks)),)


def scheduler_output(setup: VLLMSetup, *,
                     new: Mapping[str, tuple[Any, Sequence[int]]] | None = None,
                     resumed: Mapping[str, tuple[Any, Sequence[int]]] | None = None,
                     cached: Mapping[str, tuple[Any, Sequence[int]]] | None = None,
                     num_scheduled_tokens: Mapping[str, int] | None = None,
                     finished_req_ids: set[str] | frozenset[str] | None = None,
                     preempted_req_ids: set[str] | frozenset[str] | None = None,
                     boundary_state_offloads: Mapping[str, Sequence[tuple[int, int, int]]]
                     | None = None,
                     kv_cache_block_copies: Sequence[tuple[int, int]] = ()) -> Any:
    """A real `SchedulerOutput`.

    - `new`: first scheduling of a request, `{req_id: (request, whole block table)}`;
    - `resumed`: a request scheduled again after a preemption (or a reset), with its whole
      new block table (vLLM sends it as a cached request marked resumed; from 0.34.0, feature
      `resumed_as_new`, among the new requests);
    - `cached`: a request that keeps running, `{req_id: (request, blocks added this step)}`;
    - `num_scheduled_tokens`: tokens computed this step per scheduled request;
    - `finished_req_ids`: requests finished since the previous step;
    - `preempted_req_ids`: requests the core preempted since the previous step;
    - `boundary_state_offloads`: the Mamba states the core commits in this step, as
      `kv_connector_block_state` carries them (0.33; the connector reads nothing else of it);
    - `kv_cache_block_copies`: the copies the core queued, `(source, destination)`.
    """
    v = _v()
    out = v.SchedulerOutput.make_empty()
    as_new = has("resumed_as_new")

    def new_data(req: Any, blocks: Sequence[int]) -> Any:
        if as_new:  # 0.34.0: the tokens to prefill are a required argument
            return v.NewRequestData.from_request(req, _groups(blocks), req.prefill_token_ids)
        return v.NewRequestData.from_request(req, _groups(blocks))

    out.scheduled_new_reqs = [new_data(req, blocks) for req, blocks in (new or {}).values()]
    if as_new:  # a resumed request is sent in full, like a new one
        out.scheduled_new_reqs += [new_data(req, blocks)
                                   for req, blocks in (resumed or {}).values()]
        resumed = None
    ids: list[str] = []
    new_blocks: list[Any] = []
    computed: list[int] = []
    outputs: list[int] = []
    all_tokens: dict[str, list[int]] = {}
    resumed_ids: set[str] = set()
    for kind, table in (("resumed", resumed or {}), ("cached", cached or {})):
        for req_id, (req, blocks) in table.items():
            ids.append(req_id)
            new_blocks.append(_groups(blocks))
            computed.append(int(req.num_computed_tokens))
            outputs.append(len(req.output_token_ids))
            if kind == "resumed":
                resumed_ids.add(req_id)
                all_tokens[req_id] = list(req.all_token_ids)
    marked = {} if as_new else {"resumed_req_ids": resumed_ids, "all_token_ids": all_tokens}
    out.scheduled_cached_reqs = v.CachedRequestData(
        req_ids=ids, new_token_ids=[[] for _ in ids], new_block_ids=new_blocks,
        num_computed_tokens=computed, num_output_tokens=outputs, **marked)
    sched = {k: int(n) for k, n in (num_scheduled_tokens or {}).items()}
    out.num_scheduled_tokens = sched
    out.total_num_scheduled_tokens = sum(sched.values())
    out.finished_req_ids = SortedIdSet(finished_req_ids or ())
    out.preempted_req_ids = SortedIdSet(preempted_req_ids) if preempted_req_ids else None
    if kv_cache_block_copies:
        out.kv_cache_block_copies = [v.KVCacheBlockCopy(int(src), int(dst))
                                     for src, dst in kv_cache_block_copies]
    if boundary_state_offloads:
        def no_tables(req_id: str) -> tuple[list[int], ...]:
            raise NotImplementedError("the offloading connector reads only the hand-offs")

        handoffs = {r: [tuple(map(int, e)) for e in entries]
                    for r, entries in boundary_state_offloads.items()}
        tables: dict[str, Any] = (
            {"req_ids": set(sched) | set(boundary_state_offloads),
             "resolve_block_ids": no_tables} if has("block_state_resolver")
            else {"block_ids": {}})  # 0.29.0: a snapshot, which its connector does not read
        out.kv_connector_block_state = v.KVConnectorBlockState(
            **tables, boundary_state_offloads=handoffs)
    return out


def connector_output(completed_jobs: Mapping[int, int], *,
                     finished_recving: set[str] | frozenset[str] | None = None,
                     finished_sending: set[str] | frozenset[str] | None = None,
                     failed_jobs: set[int] | frozenset[int] = frozenset(),
                     failed_recving: set[str] | frozenset[str] = frozenset()) -> Any:
    """A real `KVConnectorOutput` carrying `OffloadingWorkerMetadata(completed_jobs)` (the
    counts summed over the workers, as vLLM's output aggregator does; a failing worker's
    report counts too). From 0.34.0 (feature `failure_reports`) `failed_jobs` are the jobs
    a worker of this output failed, and `failed_recving` the requests whose async load one
    failed (the aggregator passes them with their `finished_recving`)."""
    v = _v()
    failures: dict[str, Any] = {}
    if failed_jobs or failed_recving:
        if not has("failure_reports"):
            raise NotImplementedError(
                f"vLLM {releases.text(release_version())} has no failure report")
        failures = {"failed_jobs": {int(j) for j in failed_jobs}}
    meta = v.OffloadingWorkerMetadata(
        completed_jobs={int(j): int(n) for j, n in completed_jobs.items()}, **failures)
    out = v.KVConnectorOutput(
        finished_sending=set(finished_sending) if finished_sending else None,
        finished_recving=set(finished_recving) if finished_recving else None,
        kv_connector_worker_meta=meta)
    if failed_recving:
        out.failed_recving = set(failed_recving)
    return out


__all__ = ["EOS_TOKEN_ID", "SortedIdSet", "VLLMSetup", "connector_output",
           "has_reset_fence", "kv_blocks", "make_request", "make_setup",
           "manager_num_chunks", "offload_key", "request_status", "scheduler_output",
           "vllm_file", "vllm_version"]
