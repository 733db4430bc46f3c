"""The decode-graph path (hf_paged/engine/cuda_graphs.py) on CPU: engines are built with the production wiring (null block
for padding, static buffers, padding to a bucket, static metadata) and only the graph replay is replaced by a plain
call of the same forward (`capture=False`): real model, real padding, real attention. Capture itself: tests/test_gpu.py.
"""
import os

import torch

# the Triton case runs under the interpreter on CPU; as in test_triton.py, this must precede the kernels' import
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from hf_paged import SamplingParams
from hf_paged.attention import dispatch
from hf_paged.config import EngineConfig
from hf_paged.engine.cuda_graphs import (MAX_GRAPH_BATCH, MAX_GRAPH_CONTEXT, DecodeGraphRunner, DecodeGraphSettings,
                                  PaddedDecode, batch_buckets, bucket_for)
from hf_paged.engine import Engine
from hf_paged.engine.plan import StepPlan
from hf_paged.kv import NULL_BLOCK

from conftest import cached_model

PROMPT_LENS = (3, 17, 9, 30, 12)  # ragged: 1 to 4 blocks of 8
MAX_TOKENS = (20, 7, 13, 25, 4)  # finishing at different times: 5 -> 4 -> 3 -> 2 -> 1 running
# decode-only steps per bucket for those: 5 rows (tokens 2-4) in 8, 4 and 3 rows (5-13) in 4, 2 rows (14-20), 1 row
BUCKET_STEPS = {8: 3, 4: 9, 2: 7, 1: 5}


def force_padded_path(monkeypatch, **overrides) -> None:
    """Engines built afterwards take the decode-graph path on CPU. Only the device gate is replaced:
    `DecodeGraphSettings.for_engine` (None away from CUDA) returns the engine's settings with capture=False and
    `overrides` applied (unless cuda_graphs=False: the reference engines)."""
    def for_engine(config, device, num_pool_blocks, max_model_len):
        if config.cuda_graphs is False:
            return None
        settings = DecodeGraphSettings.build(config, num_pool_blocks, max_model_len, capture=False)
        for name, value in overrides.items():
            setattr(settings, name, value)
        return settings

    monkeypatch.setattr(DecodeGraphSettings, "for_engine", staticmethod(for_engine))


@pytest.fixture
def padded(monkeypatch):
    force_padded_path(monkeypatch)


def prompts(lengths=PROMPT_LENS, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def run(engine, batch, max_tokens=MAX_TOKENS, **params):
    """Greedy tokens per prompt, EOS banned until max_tokens (as HF's min_new_tokens in `hf_greedy`)."""
    for i, (prompt, count) in enumerate(zip(batch, max_tokens)):
        engine.add_request(prompt, SamplingParams(max_tokens=count, min_tokens=count, temperature=0.0, **params),
                           request_id=str(i))
    done = {}
    while engine.has_unfinished:
        for request in engine.step():
            if request.is_finished:
                done[request.parent.request_id] = list(request.output_token_ids)
    engine.check_idle()
    return [done[str(i)] for i in range(len(batch))]


def hf_greedy(model, prompt, count):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, min_new_tokens=count,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


# ---- buckets and settings ----------------------------------------------------------------------------------
def test_buckets():
    assert batch_buckets(128) == (1, 2, 4, *range(8, 129, 8))
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(5) == (1, 2, 4, 5)
    assert batch_buckets(1) == (1,)
    assert batch_buckets(10_000)[-1] == MAX_GRAPH_BATCH
    buckets = batch_buckets(128)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 17, 127, 128)] == [1, 2, 4, 8, 8, 16, 24, 128, 128]
    assert bucket_for(129, buckets) is None


def test_settings_and_config():
    config = EngineConfig(block_size=8, max_num_seqs=20)
    assert DecodeGraphSettings.for_engine(config, torch.device("cpu"), 100, 64) is None  # off on CPU
    assert DecodeGraphSettings.for_engine(config.replace(cuda_graphs=False), torch.device("cuda"), 100, 64) is None
    settings = DecodeGraphSettings.for_engine(config, torch.device("cuda"), 100, 61)
    assert (settings.max_batch, settings.max_blocks, settings.padding_block, settings.capture,
            settings.capture_at_start) == (20, 8, NULL_BLOCK, True, False)  # 61 tokens need 8 blocks; pad: null block
    assert DecodeGraphSettings.build(config, 5, 1000, capture=False).max_blocks == 5  # never more than the pool
    assert DecodeGraphSettings.build(config, 50, None, capture=False).max_blocks == 50
    assert DecodeGraphSettings.build(config, 10**6, 10**6, capture=False).max_blocks == MAX_GRAPH_CONTEXT // 8
    assert DecodeGraphSettings.for_engine(config.replace(cuda_graphs="at_start"), torch.device("cuda"), 9,
                                          None).capture_at_start
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="cuda_graphs"):
            config.replace(cuda_graphs=bad)


def test_off_on_cpu_by_default(llama):
    engine = Engine(llama, block_size=8, num_blocks=32)
    assert engine.runner.graphs is None
    assert engine.memory.cache.num_blocks == engine.scheduler.kv.pool.num_blocks + 1 == 33  # + the null block
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphRunner(engine.runner, DecodeGraphSettings(4, 8, capture=True))


def test_probe_names_the_backend(llama, padded):
    engine = Engine(llama, block_size=8, num_blocks=32)
    graphs = engine.runner.graphs
    assert engine.memory.cache.num_blocks == 33 and graphs.settings.padding_block == NULL_BLOCK  # nothing extra
    assert "'torch' attention backend" in graphs._backend_reason()  # what "auto" gives a CPU decode step
    if dispatch.unavailable("triton", torch.device("cpu")) is None:  # interpreted here: cuda / triton are captured
        engine.runner.backends = dispatch.choose_backends("triton", torch.device("cpu"))
        assert graphs._backend_reason() is None
    too_many = StepPlan(requests=[None] * 129, num_new_tokens=[1] * 129)  # max_num_seqs=128
    assert not graphs.accepts(too_many) and not graphs.accepts(StepPlan())


# ---- the padded path gives the same tokens --------------------------------------------------------------------
@pytest.mark.parametrize("arch, backend", [("llama", "auto"), ("llama", "torch"), ("gemma2", "torch"),
                                           ("mistral", "auto")])
def test_padded_decode_matches_hf_and_eager_engine(padded, arch, backend):
    """5 ragged requests finishing at different times: buckets 8, 4, 2, 1 with padding rows, same tokens as HF
    generate and as the engine without the padded path."""
    model = cached_model(arch)
    batch = prompts()
    options = dict(block_size=8, num_blocks=64, max_model_len=64, attention_backend=backend)
    engine = Engine(model, **options)
    got = run(engine, batch)
    assert dict(engine.runner.graphs.steps_per_bucket) == BUCKET_STEPS
    assert got == [hf_greedy(model, p, n) for p, n in zip(batch, MAX_TOKENS)]
    assert got == run(Engine(model, cuda_graphs=False, **options), batch)


def test_padded_decode_on_triton_with_fixed_splits(padded):
    """The Triton kernel with the static metadata: max_context_len pinned to max_model_len fixes a split-KV count > 1,
    so most splits of these short sequences are empty; tokens still equal HF's."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'hf_paged[triton]')")
    from hf_paged.attention import triton_backend as tb

    model = cached_model("llama")
    batch = prompts((5, 14, 9), seed=8)
    counts = (9, 4, 6)
    engine = Engine(model, block_size=8, num_blocks=64, attention_backend="triton")
    metadata = engine.runner.graphs._batch(4).metadata
    assert metadata.max_context_len == 512 and tb.split_count(4, 2, 1, metadata.max_context_len, 132) > 1
    assert run(engine, batch, counts) == [hf_greedy(model, p, n) for p, n in zip(batch, counts)]
    assert set(engine.runner.graphs.steps_per_bucket) == {4, 2, 1}


def test_one_token_prefill_chunks_sample_only_last_rows(padded, llama):
    """long_prefill_token_threshold=1 makes every step decode-shaped, with rows that do not sample (prompt chunks):
    the padded path returns only the sampled rows, in order."""
    batch = prompts((4, 7, 2), seed=5)
    counts = (5, 3, 6)
    engine = Engine(llama, block_size=4, num_blocks=32, max_model_len=32, long_prefill_token_threshold=1)
    assert run(engine, batch, counts) == [hf_greedy(llama, p, n) for p, n in zip(batch, counts)]
    assert sum(engine.runner.graphs.steps_per_bucket.values()) == engine.stats()["num_steps"]  # every step padded


def test_padded_logits_equal_eager_logits_in_any_row_order(padded, llama):
    """The scheduler puts sampling rows first; the runner must not rely on it. A step with a prompt chunk (no
    sample) ahead of a sampling row gives the eager path's logits for exactly the sampled rows."""
    engine = Engine(llama, block_size=4, num_blocks=32, max_model_len=32, long_prefill_token_threshold=1)
    for prompt in prompts((6, 2, 5), seed=6):
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()  # position 0 of every prompt: the 2-token prompt now has its last (sampling) token left
    batch = engine.scheduler.schedule()
    batch.requests.reverse()
    batch.num_new_tokens.reverse()
    engine.memory.apply(batch)  # clears the blocks handed out
    runner, graphs = engine.runner, engine.runner.graphs
    step = runner.prepare(batch)
    assert isinstance(step, PaddedDecode) and step.size == 4 and step.sampled == [2]
    got = runner.execute(step)
    runner.graphs = None  # the same batch on the eager path (it writes the same K/V again)
    want = runner.execute(runner.prepare(batch))
    runner.graphs = graphs
    assert got.shape == want.shape == (1, 256)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_preemption_and_prefix_hits_under_a_tight_pool(padded, llama):
    """Recompute preemption and prefix-cache hits mix eager prefill steps with padded decode steps."""
    shared = prompts((16,), seed=9)[0]
    batch = [shared + p for p in prompts((3, 9, 5, 12, 6, 1), seed=2)]
    counts = (12, 10, 14, 8, 12, 10)
    tight = Engine(llama, block_size=4, num_blocks=16, max_model_len=64, preemption_mode="recompute")
    got = run(tight, batch, counts)
    assert tight.stats()["num_preemptions"] > 0 and tight.stats()["prefix_cache_hit_tokens"] > 0
    roomy = Engine(llama, block_size=4, num_blocks=256, cuda_graphs=False)
    assert got == run(roomy, batch, counts)
    assert sum(tight.runner.graphs.steps_per_bucket.values()) > 0


def test_fp8_cache_scales_are_fixed_before_the_first_step(padded, llama):
    """fp8 scales are calibrated when the engine starts, graphs or not: with every step decode-shaped (1-token prompt
    chunks), the first one too takes the padded path (padding rows never set scales); the scales and the tokens equal
    the engine without graphs."""
    batch = prompts((4, 6), seed=2)
    counts = (6, 4)
    options = dict(block_size=4, num_blocks=32, max_model_len=32, long_prefill_token_threshold=1,
                   kv_cache_dtype="fp8_e4m3")
    engine = Engine(llama, **options)
    eager = Engine(llama, cuda_graphs=False, **options)
    assert None not in engine.memory.cache.kv_scales and engine.memory.cache.kv_scales == eager.memory.cache.kv_scales
    got = run(engine, batch, counts)
    assert sum(engine.runner.graphs.steps_per_bucket.values()) == engine.stats()["num_steps"]
    assert got == run(eager, batch, counts)


def test_contexts_longer_than_the_tables_run_eagerly(llama, monkeypatch):
    """Graphs whose tables hold 2 blocks of 8 serve decodes at positions < 16 only; later steps go eager."""
    force_padded_path(monkeypatch, max_blocks=2)
    batch = prompts((3, 9), seed=7)
    counts = (16, 10)
    engine = Engine(llama, block_size=8, num_blocks=16, max_model_len=64)
    assert run(engine, batch, counts) == [hf_greedy(llama, p, n) for p, n in zip(batch, counts)]
    # decode k (k = 1..) is at position 8 + k of the 9-token prompt (until k = 9) and 2 + k of the 3-token one (until
    # k = 15): both below 16 for k <= 7 (bucket 2), then the second alone for k = 10..13 (bucket 1), eager after that
    assert dict(engine.runner.graphs.steps_per_bucket) == {2: 7, 1: 4}


def test_a_failed_capture_turns_graphs_off_and_the_step_still_runs(padded, llama, caplog):
    """Capturing on CPU fails (no CUDA stream), like a forward that syncs would on a GPU: that step runs the padded
    inputs eagerly, later steps take the ordinary eager path, and the tokens are unchanged."""
    batch = prompts((6, 11), seed=1)
    counts = (5, 7)
    engine = Engine(llama, block_size=8, num_blocks=16, max_model_len=64)
    engine.runner.graphs.settings.capture = True
    assert run(engine, batch, counts) == [hf_greedy(llama, p, n) for p, n in zip(batch, counts)]
    graphs = engine.runner.graphs
    assert "capturing the decode graph of batch size 2 failed" in graphs.off_reason
    assert "CUDA graphs turned off" in caplog.text
    assert dict(graphs.steps_per_bucket) == {2: 1} and not graphs.captured


def test_capture_at_start_goes_largest_first_on_padding_rows(padded, llama):
    """cuda_graphs="at_start" captures every bucket from the largest down, each on padding rows only; here the first
    capture fails (no CUDA), which turns graphs off before any other is tried."""
    engine = Engine(llama, block_size=8, num_blocks=16, max_num_seqs=20, cuda_graphs="at_start")
    graphs = engine.runner.graphs
    assert graphs.settings.capture_at_start and graphs.buckets == (1, 2, 4, 8, 16, 20)
    graphs.settings.capture = True
    graphs.capture_all()
    assert "batch size 20 failed" in graphs.off_reason and set(graphs.batches) == {20}
    staged = graphs.batches[20]
    null = NULL_BLOCK
    assert staged.metadata.slot_mapping.tolist() == [null * 8] * 20 and staged.context_lens.tolist() == [1] * 20
    assert staged.input_ids.tolist() == [[0] * 20] and (staged.tables == null).all()


# ---- padding rows never touch a request's KV --------------------------------------------------------------------
def padded_step_writes(engine) -> tuple[set, set]:
    """Run one step (it must be a padded decode step with padding rows) and return (the slots it wrote, the slots it
    had to write: each real row's, plus slot 0 of the null block). Blocks no request holds, the null block
    included, are first filled with a sentinel, so that every write shows."""
    storage = engine.memory.cache.storage
    held = {b for r in engine.scheduler.running for b in r.block_table}
    storage[:, :, [b for b in range(engine.memory.cache.num_blocks) if b not in held]] = 7.0
    bs = engine.memory.cache.block_size
    expected = {r.block_table[r.num_computed_tokens // bs] * bs + r.num_computed_tokens % bs
                for r in engine.scheduler.running} | {NULL_BLOCK * bs}
    before = storage.clone()
    steps = dict(engine.runner.graphs.steps_per_bucket)
    engine.step()
    (bucket,) = [b for b, n in engine.runner.graphs.steps_per_bucket.items() if n != steps.get(b, 0)]
    assert bucket > len(engine.scheduler.running), "the step had no padding rows"
    changed = (storage != before).flatten(4).any(-1).any(0).any(0)  # [blocks, block_size]
    return {int(b) * bs + int(o) for b, o in changed.nonzero()}, expected


def check_only_real_slots_written(engine):
    written, expected = padded_step_writes(engine)
    assert written == expected, (f"slots written besides the real rows' and the null slot: "
                                 f"{sorted(written - expected)}; not written: {sorted(expected - written)}")


def start_three_requests(engine):
    for i, prompt in enumerate(prompts((17, 5, 11), seed=4)):
        engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefills (eager); every later step is a decode of 3 rows in bucket 4


def test_padding_rows_write_only_the_null_block(padded, llama):
    engine = Engine(llama, block_size=8, num_blocks=16, max_model_len=64)
    start_three_requests(engine)
    for _ in range(3):
        check_only_real_slots_written(engine)
    assert engine.runner.graphs.steps_per_bucket[4] == 3


def test_the_write_check_catches_padding_aimed_at_a_real_block(llama, monkeypatch):
    """The same check fails when the padding slot is a block a request holds (block 1: the first prompt's second)."""
    force_padded_path(monkeypatch, padding_block=1)
    engine = Engine(llama, block_size=8, num_blocks=16, max_model_len=64)
    start_three_requests(engine)
    assert 1 in engine.scheduler.running[0].block_table
    with pytest.raises(AssertionError, match=r"slots written besides the real rows' and the null slot: \[8\]"):
        check_only_real_slots_written(engine)
