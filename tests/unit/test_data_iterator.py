"""PromptIterator: deterministic epochs, disjoint DP shards, exact resume."""

from __future__ import annotations

import copy
import json

import pytest

from cooper_mcore.data.iterator import PromptIterator
from cooper_mcore.types import Prompt

PROMPTS = [Prompt(id=f"p{i}", question=f"q{i}", answer=str(i)) for i in range(20)]


def _ids(batch):
    return [p.id for p in batch]


def _global(it_factory, dp_size, steps):
    """Each step's per-rank id lists, from dp_size independent iterators."""
    its = [it_factory(rank) for rank in range(dp_size)]
    return [[_ids(it.next_batch()) for it in its] for _ in range(steps)]


def test_shards_are_disjoint_and_form_the_global_batch():
    steps = 9  # 2 batches of 8 per epoch of 20 prompts: crosses four epoch boundaries
    single = _global(lambda r: PromptIterator(PROMPTS, 8, dp_rank=r, dp_size=1, seed=3), 1, steps)
    sharded = _global(lambda r: PromptIterator(PROMPTS, 8, dp_rank=r, dp_size=4, seed=3), 4, steps)
    for one, four in zip(single, sharded):
        assert all(len(s) == 2 for s in four)
        flat = [i for s in four for i in s]
        assert len(set(flat)) == 8  # disjoint
        assert flat == one[0]  # rank order concatenated = the global batch of a dp_size=1 run


def test_epochs_are_permutations_and_reshuffle():
    it = PromptIterator(PROMPTS, 5, seed=0)
    epochs = [[i for _ in range(4) for i in _ids(it.next_batch())] for _ in range(3)]
    for e in epochs:
        assert sorted(e) == sorted(p.id for p in PROMPTS)  # every prompt once per epoch
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != [p.id for p in PROMPTS]  # actually shuffled
    again = PromptIterator(PROMPTS, 5, seed=0)
    assert [i for _ in range(4) for i in _ids(again.next_batch())] == epochs[0]  # deterministic
    other = PromptIterator(PROMPTS, 5, seed=1)
    assert [i for _ in range(4) for i in _ids(other.next_batch())] != epochs[0]
    plain = PromptIterator(PROMPTS, 5, shuffle=False)
    assert _ids(plain.next_batch()) == ["p0", "p1", "p2", "p3", "p4"]


def test_drop_last_and_wrap_around():
    dropped = PromptIterator(PROMPTS, 6, seed=2)  # 3 batches per epoch, 2 prompts dropped
    assert dropped.batches_per_epoch == 3
    first = [_ids(dropped.next_batch()) for _ in range(4)]
    assert (dropped.epoch, dropped.index) == (1, 6)
    assert len({i for b in first[:3] for i in b}) == 18
    wrap = PromptIterator(PROMPTS, 6, seed=2, drop_last=False)
    seq = [i for _ in range(10) for i in _ids(wrap.next_batch())]  # 60 prompts = 3 full epochs
    for e in range(3):
        assert sorted(seq[20 * e:20 * (e + 1)]) == sorted(p.id for p in PROMPTS)
    assert seq[:18] == [i for b in first[:3] for i in b]  # same epoch-0 order as drop_last
    small = PromptIterator(PROMPTS[:3], 4, dp_size=2, drop_last=False, shuffle=False)
    assert _ids(small.next_batch()) == ["p0", "p1"]
    assert (small.epoch, small.index) == (1, 1)


@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_equals_uninterrupted(drop_last):
    def make(rank=0, dp=2):
        return PromptIterator(PROMPTS, 6, dp_rank=rank, dp_size=dp, seed=11, drop_last=drop_last)

    ref = make()
    expected = [_ids(ref.next_batch()) for _ in range(12)]
    run = make()
    got = [_ids(run.next_batch()) for _ in range(5)]
    state = json.loads(json.dumps(run.state_dict()))  # survives a JSON checkpoint
    del run
    resumed = make()
    resumed.load_state_dict(state)
    got += [_ids(resumed.next_batch()) for _ in range(7)]
    assert got == expected
    assert resumed.step == 12
    # the state is global: rank 1 resumed from rank 0's state continues with its own shard
    ref1, other = make(rank=1), make(rank=1)
    expected1 = [_ids(ref1.next_batch()) for _ in range(12)]
    other.load_state_dict(state)
    assert [_ids(other.next_batch()) for _ in range(7)] == expected1[5:]


def test_state_mismatch_and_bad_arguments():
    it = PromptIterator(PROMPTS, 4, seed=0)
    it.next_batch()
    state = it.state_dict()
    with pytest.raises(ValueError, match="seed=0 in the state, 1 here"):
        PromptIterator(PROMPTS, 4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="num_prompts"):
        PromptIterator(PROMPTS[:10], 4, seed=0).load_state_dict(state)
    renamed = copy.deepcopy(PROMPTS)
    renamed[3].id = "other"
    with pytest.raises(ValueError, match="fingerprint"):
        PromptIterator(renamed, 4, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="invalid position"):
        PromptIterator(PROMPTS, 4, seed=0).load_state_dict({**state, "index": 21})
    with pytest.raises(ValueError, match="global_batch_size=6 is not divisible by dp_size=4"):
        PromptIterator(PROMPTS, 6, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank=2"):
        PromptIterator(PROMPTS, 4, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        PromptIterator(PROMPTS, 32)
    with pytest.raises(ValueError, match="empty"):
        PromptIterator([], 4)
