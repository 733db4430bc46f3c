"""The batched sampler against an independent float64 reference (plain Python math, one row at a time).

Reference semantics (HF's warper order, which vLLM shares): temperature, then top-k, then top-p over the
renormalized top-k distribution (keep a token while the mass strictly before it is < top_p), then min-p
(drop tokens whose prob < min_p * max prob); the top token always survives.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from hf_paged import sampling
from hf_paged.sampling import ARGMAX_BLOCK, Sampler, SamplingParams, _penalize, _truncate, first_argmax

CPU = torch.device("cpu")
V = 12


def row_logits(seed: int, scale: float = 2.0, vocab: int = V) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


# ---- float64 reference -----------------------------------------------------------------------------
def ref_penalized(row: list[float], history: list[int], outputs: list[int], p: SamplingParams) -> list[float]:
    """Repetition penalty over prompt+output tokens, then presence/frequency over output tokens."""
    out = [float(x) for x in row]
    for t in set(history):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, count in Counter(outputs).items():
        out[t] -= p.frequency_penalty * count + p.presence_penalty
    return out


def ref_distribution(row: list[float], p: SamplingParams) -> tuple[list[float], float]:
    """Sampling probabilities, and the smallest distance of any top-p / min-p decision to its threshold."""
    x = [float(v) / p.temperature for v in row]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    kept = order[:p.top_k] if p.top_k > 0 else order
    weights = {i: math.exp(x[i] - x[kept[0]]) for i in kept}
    total = sum(weights.values())
    q = {i: w / total for i, w in weights.items()}
    margin, before, nucleus = math.inf, 0.0, []
    for i in kept:
        if p.top_p < 1.0:
            margin = min(margin, abs(before - p.top_p))
        if i == kept[0] or before < p.top_p:
            nucleus.append(i)
        before += q[i]
    top = q[kept[0]]
    if p.min_p > 0.0:
        margin = min([margin] + [abs(q[i] - p.min_p * top) for i in nucleus])
    final = [i for i in nucleus if i == kept[0] or q[i] >= p.min_p * top]
    total = sum(q[i] for i in final)
    return [q[i] / total if i in final else 0.0 for i in range(len(x))], margin


def ref_log_softmax(row: list[float]) -> list[float]:
    m = max(row)
    lse = m + math.log(sum(math.exp(v - m) for v in row))
    return [v - lse for v in row]


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper 1e-4 quantile of chi-square(df), Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


CASES = [  # (logits seed, params); every truncating case is checked to really drop tokens
    (1, SamplingParams(temperature=0.7)),
    (2, SamplingParams(temperature=1.3, top_k=5)),
    (3, SamplingParams(top_p=0.6)),
    (4, SamplingParams(temperature=0.8, min_p=0.15)),
    (16, SamplingParams(top_k=5, top_p=0.7)),  # top-p over the top-k mass keeps 3, over the full mass 4
    (14, SamplingParams(temperature=1.5, top_k=6, top_p=0.9, min_p=0.2)),  # min-p drops 2 of top-p's 5
    (12, SamplingParams(temperature=1.5, top_k=6, top_p=0.9, min_p=0.2)),  # top-p: 5 of top-k, 6 of all
    (7, SamplingParams(temperature=2.0, top_p=0.5, min_p=0.3)),
    (8, SamplingParams(temperature=0.9, top_k=1)),
    (9, SamplingParams(temperature=1.2, top_k=-1, top_p=0.85)),
]


def reference_cases():
    for seed, params in CASES:
        logits = row_logits(seed)
        probs, margin = ref_distribution(logits.tolist(), params)
        assert margin > 1e-4, f"case {seed} sits on a threshold; float32 vs float64 would be flaky"
        truncating = params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0
        assert not truncating or sum(pr > 0 for pr in probs) < V, f"case {seed} truncates nothing"
        yield seed, logits, params, probs


# ---- truncation and sampling distribution ---------------------------------------------------------------
def test_truncation_support_and_probs_match_reference():
    """One heterogeneous batch through `_truncate`: per row, the finite set and the softmax equal the reference."""
    cases = list(reference_cases())
    logits = torch.stack([c[1] for c in cases])
    params = [c[2] for c in cases]
    temperature = torch.tensor([p.temperature for p in params])[:, None]
    truncated = _truncate(logits / temperature, params)
    probs = truncated.double().softmax(dim=-1)
    for row, (seed, _, _, expected) in enumerate(cases):
        support = {i for i in range(V) if torch.isfinite(truncated[row, i])}
        assert support == {i for i in range(V) if expected[i] > 0}, f"case {seed}"
        assert probs[row].tolist() == pytest.approx(expected, abs=1e-6), f"case {seed}"


def test_sampled_frequencies_match_reference():
    """20k seeded draws per case: never outside the support, chi-square within its 1e-4 quantile."""
    draws = 20000
    cases = list(reference_cases())
    logits = torch.stack([c[1] for c in cases]).repeat_interleave(draws, dim=0)
    params = [c[2] for c in cases for _ in range(draws)]
    n = len(params)
    out = Sampler(CPU, seed=0)(logits, params, [[]] * n, [[]] * n, [None] * n, [[]] * n)
    tokens = torch.tensor(out.token_ids).view(len(cases), draws)
    for row, (seed, _, _, expected) in enumerate(cases):
        counts = torch.bincount(tokens[row], minlength=V).tolist()
        support = [i for i in range(V) if expected[i] > 0]
        assert all(counts[i] == 0 for i in range(V) if expected[i] == 0), f"case {seed}: {counts}"
        if len(support) > 1:
            stat = sum((counts[i] - draws * expected[i]) ** 2 / (draws * expected[i]) for i in support)
            assert stat < chi2_critical(len(support) - 1), f"case {seed}: chi2 {stat:.1f}, {counts}"


# ---- penalties ------------------------------------------------------------------------------------------
def test_penalties_match_reference():
    """Repetition over prompt+output (divide positives, multiply negatives); presence/frequency over outputs."""
    prompt = [0, 3, 3, 7, 10]
    output = [3, 5, 5, 5, 11, 0]
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(presence_penalty=0.8, frequency_penalty=0.3),
        SamplingParams(repetition_penalty=0.6, presence_penalty=-0.5, frequency_penalty=1.1),
        SamplingParams(),  # untouched in a batch where other rows are penalized
    ]
    logits = torch.stack([row_logits(20 + row) for row in range(len(params))])
    assert (logits[:, prompt + output] > 0).any() and (logits[:, prompt + output] < 0).any()
    history = [prompt + output] * len(params)
    outputs = [output] * len(params)
    got = _penalize(logits, history, outputs, params)
    for row, p in enumerate(params):
        expected = ref_penalized(logits[row].tolist(), prompt + output, output, p)
        assert got[row].tolist() == pytest.approx(expected, abs=1e-6, rel=0), f"row {row} {p}"
    assert torch.equal(got[3], logits[3])


# ---- logprobs -------------------------------------------------------------------------------------------
def test_logprobs_are_raw_log_softmax_of_sampled_and_top_k():
    """Keys: the sampled token plus the raw top-k; values: log_softmax of the raw logits (no penalty/temperature)."""
    prompt = [0, 1, 2]
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=3, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=50.0, logprobs=2),  # penalty moves the argmax
        SamplingParams(temperature=1.0, frequency_penalty=1.0, logprobs=0),
        SamplingParams(temperature=1.0, logprobs=None),
    ]
    logits = torch.tensor([[4.0, 3.5, 3.0, 1.0, 0.5, -0.5, -1.0, -2.0, 0.0, 0.25, -3.0, 2.0]] * len(params))
    logits = logits + torch.stack([row_logits(40 + r, scale=0.1) for r in range(len(params))])
    gens = [torch.Generator().manual_seed(3) if p.seed is not None else None for p in params]
    n = len(params)
    out = Sampler(CPU, seed=1)(logits, params, [prompt] * n, [[2, 2]] * n, gens, [[]] * n)
    assert out.logprobs[3] is None
    assert out.token_ids[1] not in (0, 1), "the greedy row should have been pushed off the raw top-2"
    for row, p in enumerate(params[:3]):
        raw = logits[row].tolist()
        expected = ref_log_softmax(raw)
        top = sorted(range(V), key=lambda i: -raw[i])[:p.logprobs]
        entry = out.logprobs[row]
        assert set(entry) == {out.token_ids[row], *top}, f"row {row}"
        for token, value in entry.items():
            assert value == pytest.approx(expected[token], abs=1e-6), f"row {row} token {token}"


# ---- greedy rows, banned tokens ----------------------------------------------------------------------------
@pytest.mark.parametrize("with_sampled_rows", [False, True], ids=["all-greedy", "mixed"])
def test_greedy_rows_take_argmax_and_banned_tokens_are_never_chosen(with_sampled_rows):
    """Greedy rows give the argmax of the penalized, ban-masked logits; sampled rows never draw a banned token."""
    base = row_logits(60)
    order = base.argsort(descending=True).tolist()
    greedy = SamplingParams(temperature=0.0)
    rows = [  # (params, history, banned, expected greedy token)
        (greedy, [], [], order[0]),
        (greedy, [], [order[0]], order[1]),
        (greedy, [], order[:3], order[3]),
        (SamplingParams(temperature=0.0, repetition_penalty=1e3), [order[0]], [], order[1]),
    ]
    sampled = 3000 if with_sampled_rows else 0
    banned_sampled = order[:4] + order[-2:]
    rows += [(SamplingParams(temperature=3.0), [], banned_sampled, None)] * sampled
    n = len(rows)
    out = Sampler(CPU, seed=2)(base.repeat(n, 1), [r[0] for r in rows], [r[1] for r in rows], [[]] * n,
                               [None] * n, [r[2] for r in rows])
    for row, (_, _, banned, expected) in enumerate(rows[:4]):
        assert out.token_ids[row] == expected, f"greedy row {row}"
    drawn = Counter(out.token_ids[4:])
    assert not set(drawn) & set(banned_sampled), drawn
    assert not with_sampled_rows or set(drawn) == set(range(V)) - set(banned_sampled)


@pytest.mark.parametrize("blocked_from", [0, None])  # 0: the blocked form on every size; None: as shipped
@pytest.mark.parametrize("vocab", [7, 2 * ARGMAX_BLOCK, 5 * ARGMAX_BLOCK + 3, 32000, 50257])
def test_first_argmax_is_the_first_maximum_of_each_row(vocab, blocked_from, monkeypatch):
    """The blockwise greedy pick equals a plain scan for the first maximum: ties inside a block, across blocks and
    between the full blocks and a partial last block, rows of -inf and rows whose maximum is the last entry."""
    if blocked_from is not None:
        monkeypatch.setattr(sampling, "ARGMAX_BLOCKED_FROM", blocked_from)
    gen = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=gen), torch.randint(0, 3, (vocab,), generator=gen).float(),
            torch.full((vocab,), float("-inf")), torch.zeros(vocab)]
    last = torch.randn(vocab, generator=gen)
    last[-1] = 100.0
    tie = torch.randn(vocab, generator=gen)
    tie[vocab // 3] = tie[-1] = 100.0  # the same maximum in a full block and in the tail
    late = torch.randn(vocab, generator=gen)
    late[vocab - vocab % ARGMAX_BLOCK - 1] = late[-2] = 50.0  # end of the full blocks vs the tail
    logits = torch.stack(rows + [last, tie, late])
    expected = [max(range(vocab), key=lambda i, row=row: (row[i], -i)) for row in logits.tolist()]
    assert first_argmax(logits).tolist() == expected


# ---- per-request seeds ------------------------------------------------------------------------------------
def seeded_tokens(seed: int, others: list[tuple[SamplingParams, int | None]], sampler_seed: int, steps: int = 40):
    """Tokens of one seeded row over `steps` calls, placed after `others` (params, own seed or None)."""
    target = SamplingParams(temperature=1.0, top_k=8, seed=seed)
    params = [p for p, _ in others] + [target]
    gens = [None if s is None else torch.Generator().manual_seed(s) for _, s in others]
    gens.append(torch.Generator().manual_seed(seed))
    logits = torch.stack([row_logits(80 + r, scale=0.5) for r in range(len(others))] + [row_logits(99, 0.5)])
    sampler = Sampler(CPU, seed=sampler_seed)
    n = len(params)
    history = [[1, 2, 3]] * n
    return [sampler(logits, params, history, history, gens, [[]] * n).token_ids[-1] for _ in range(steps)]


def test_seeded_row_is_independent_of_the_rest_of_the_batch():
    """Same seed, same tokens alone or among unseeded, other-seeded, greedy and penalized rows."""
    alone = seeded_tokens(1234, [], sampler_seed=0)
    others = [(SamplingParams(temperature=1.0), None), (SamplingParams(temperature=0.7, top_p=0.8), 5),
              (SamplingParams(temperature=0.0), None), (SamplingParams(repetition_penalty=1.3,
                                                                      presence_penalty=0.5), None)]
    assert seeded_tokens(1234, others, sampler_seed=77) == alone
    assert len(set(alone)) > 3, "the target row barely varies; the check would prove little"
    assert seeded_tokens(4321, [], sampler_seed=0) != alone


# ---- validation -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, kwargs", [
    ("max_tokens", {"max_tokens": 0}), ("max_tokens", {"max_tokens": 2.0}), ("max_tokens", {"max_tokens": True}),
    ("min_tokens", {"min_tokens": -1}), ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("n", {"n": 0}), ("top_k", {"top_k": -2}),
    ("temperature", {"temperature": -0.01}), ("temperature", {"temperature": math.nan}),
    ("top_p", {"top_p": 0.0}), ("top_p", {"top_p": 1.01}), ("top_p", {"top_p": math.nan}),
    ("min_p", {"min_p": -0.1}), ("min_p", {"min_p": 1.5}),
    ("repetition_penalty", {"repetition_penalty": 0.0}), ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("presence_penalty", {"presence_penalty": 2.5}), ("frequency_penalty", {"frequency_penalty": -2.1}),
    ("logprobs", {"logprobs": -1}), ("cache_salt", {"cache_salt": 5}),
    ("stop", {"stop": [""]}), ("stop_token_ids", {"stop_token_ids": [-1]}),
])
def test_validate_rejects_bad_values_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs).validate()


def test_validate_accepts_boundary_values():
    SamplingParams(temperature=0.0, top_k=-1, top_p=1.0, min_p=1.0, presence_penalty=-2.0,
                   frequency_penalty=2.0, logprobs=0, min_tokens=16, max_tokens=16, stop="x").validate()
