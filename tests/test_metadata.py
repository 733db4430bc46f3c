"""attention/metadata.py: one step's packed description: cumulative query lengths, tables padded with the null block,
decodes / fresh prompts / continued prefills planned apart, long decode groups split by length, and the dense masks."""
import torch

from hf_paged.attention import AttentionMetadata

CPU = torch.device("cpu")


def build(query_lens, context_lens, block_size=4):
    tables = [list(range(1 + 10 * i, 1 + 10 * i + -(-c // block_size))) for i, c in enumerate(context_lens)]
    return AttentionMetadata.build(query_lens, context_lens, tables, list(range(sum(query_lens))), block_size, CPU)


def test_each_kind_of_sequence_is_planned_apart():
    meta = build([1, 5, 3, 1], [9, 5, 7, 2])  # decode, fresh prompt, chunk after 4 cached, decode
    assert meta.cu_seqlens_q.tolist() == [0, 1, 6, 9, 10] and meta.max_query_len == 5 and meta.max_context_len == 9
    assert meta.block_tables[3].tolist() == [31, 0, 0]  # padded with the null block
    assert meta.fresh == [(1, 6)]
    (decodes,) = meta.decode_tiles()
    assert decodes.rows.tolist() == [0, 9] and decodes.query_start.flatten().tolist() == [8, 1]
    (chunk,) = meta.other_tiles()
    assert chunk.rows.tolist() == [6, 7, 8] and chunk.positions().tolist() == [[4, 5, 6]] and chunk.kv_len == 8
    assert meta.all_decodes() is decodes


def test_many_decodes_of_very_different_lengths_are_split():
    lengths = [3] * 8 + [200] * 8
    meta = build([1] * 16, lengths)
    groups = meta.decode_tiles()
    assert [sorted(g.context_lens.flatten().tolist()) for g in groups] == [[3] * 8, [200] * 8]
    assert meta.all_decodes().rows.tolist() == list(range(16))  # one group of them all, for ragged kernels
    assert len(build([1] * 16, [190 + i for i in range(16)]).decode_tiles()) == 1  # no saving: one group


def test_the_dense_mask_is_causal_at_the_bottom_right_with_window_and_chunk():
    meta = build([3, 2], [5, 6])  # two continued prefills, padded to 3 queries
    (group,) = meta.other_tiles()
    mask = group.mask(None)[:, 0]
    assert mask[0, 0, :5].tolist() == [True, True, True, False, False]  # query at position 2 sees keys 0..2
    assert mask[1, 2].all()  # a padding row attends to everything (its output is dropped)
    windowed = group.mask(2)[:, 0]
    assert windowed[0, 2, :6].tolist() == [False, False, False, True, True, False]
    chunked = group.mask(None, 4)[:, 0]
    assert chunked[1, 1, :6].tolist() == [False, False, False, False, True, True]  # position 5: its chunk is 4..7
    assert group.mask(None) is group.mask(None)  # built once per step and kept for the other layers


def test_the_decode_plan_holds_what_the_dense_plan_holds():
    """Decode groups take a shortcut (`_decode_plan`: fewer host-to-tensor copies); every field, dtype and shape equals
    the general plan's, for decodes in any order among other sequences and tables longer than their context."""
    from dataclasses import fields

    from hf_paged.attention import metadata

    query_lens = [1, 4, 1, 1, 3, 1]
    context_lens = [9, 4, 1, 17, 8, 33]
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    tables = [list(range(1 + 10 * i, 1 + 10 * i + -(-c // 4) + 2)) for i, c in enumerate(context_lens)]  # 2 spare
    for members in ([0, 2, 3, 5], [5, 0], [3]):
        short = metadata._decode_plan(members, cu, context_lens, tables, 4, CPU)
        dense = metadata._dense_plan(members, cu, query_lens, context_lens, tables, 4, CPU)
        for f in fields(dense):
            a, b = getattr(short, f.name), getattr(dense, f.name)
            if isinstance(b, torch.Tensor):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f.name
            else:
                assert a == b, f.name


def test_a_step_of_decodes_only_gives_kernels_its_whole_tables_as_int64_once():
    """`decode_tables`: a step whose sequences are all decodes hands ragged-length kernels the step's own tables and
    lengths (int64, the same tensors for every layer), tables wider than the contexts included; any step with
    another kind of sequence gives None (its rows are not one per sequence)."""
    meta = build([1, 1, 1], [9, 1, 17])
    tables, lengths = meta.decode_tables()
    assert tables.dtype == lengths.dtype == torch.int64 and meta.decode_tables()[0] is tables
    assert torch.equal(tables, meta.block_tables.long()) and lengths.tolist() == [9, 1, 17]
    assert meta._decodes is None  # no tile built for it
    assert build([1, 5], [9, 5]).decode_tables() is None and build([3], [8]).decode_tables() is None
