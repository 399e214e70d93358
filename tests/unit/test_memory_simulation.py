"""The memory simulation's pieces (cooper_mcore/planner/{memory_tracker,fake_device,stand_ins,comparison}.py)
against hand-computed bytes and values: live bytes counted once per storage, followed through a
resize and a death; fake tensors that keep host values where the trainer reads them, finite
placeholders elsewhere, autograd through both; collectives on the fake process group; the
stand-ins' lengths. The whole step on a real preset is tests/rehearsal/test_memory_simulation.py."""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.distributed as dist

from cooper_mcore.data.templates import rm_input
from cooper_mcore.parallel import ParallelConfig
from cooper_mcore.planner.comparison import KindCheck, PhaseCheck, format_checks
from cooper_mcore.planner.fake_device import SMALL_NUMEL, BroadcastLog, simulated_device, simulated_world
from cooper_mcore.planner.memory_tracker import MemoryTracker
from cooper_mcore.planner.stand_ins import (
    GOLD,
    StandInAssistant,
    StandInEngine,
    StandInVerifier,
    WordTokenizer,
    stand_in_prompts,
)
from cooper_mcore.rollout.base import SamplingParams

MIB = 2**20
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_tracker_counts_a_storage_once_follows_resizes_and_deaths_and_keeps_phase_peaks():
    tracker = MemoryTracker(vocab_widths={1000})
    a = torch.empty(MIB, dtype=torch.uint8)
    tracker.saw(a)
    tracker.saw(a.view(2, -1))  # a view: the same storage
    assert tracker.total == MIB and tracker.by_kind["activations"] == MIB
    with tracker.phase("logprobs"):
        logits = torch.empty(4, 1000)
        tracker.saw(logits)  # a vocabulary-wide last dimension
        assert tracker.by_kind["logits"] == 16_000
        del logits
        gc.collect()
    assert tracker.total == MIB
    peak = tracker.peaks["logprobs"]
    assert (peak.total, peak.kinds["logits"]) == (MIB + 16_000, 16_000)
    a.untyped_storage().resize_(0)  # what offloading does
    tracker.resized(a.untyped_storage())
    assert tracker.total == 0
    state = torch.empty(256)
    tracker.saw(state, state=True)
    tracker.label("policy_grads", [state.untyped_storage()])
    assert (tracker.by_kind["other"], tracker.by_kind["policy_grads"]) == (0, 1024)
    host = torch.empty(100, dtype=torch.uint8)
    tracker.saw(host, host=True)
    assert (tracker.total, tracker.host, tracker.host_peak) == (1024, 100, 100)
    assert tracker.interval_peak() == MIB + 16_000 and tracker.interval_peak() == 1024


def test_fake_tensors_train_keep_host_values_and_give_finite_placeholders():
    tracker = MemoryTracker()
    with simulated_device(tracker):
        w = torch.nn.Parameter(torch.empty(2048, 1024))  # 8 MiB: no values (the device's)
        x = torch.empty(1024, 1024)
        ids = torch.tensor([3, 1, 2])  # a host value
        assert ids.tolist() == [3, 1, 2] and int(ids.sum()) == 6
        h = x @ w.t()  # 8 MiB of activations, fake
        loss = torch.log(h.float().pow(2).mean())  # small, from fake: a finite placeholder
        assert math.isfinite(loss.item()) and bool(torch.isfinite(loss))
        assert torch.tensor([loss, loss]).tolist() == [loss.item()] * 2  # a read that bypasses the dispatcher
        loss.backward()
        assert w.grad is not None and w.grad.shape == w.shape
        assert tracker.by_kind["activations"] >= 8 * MIB  # x, h (and the grad) counted; ids are host values
        small = torch.arange(SMALL_NUMEL)
        assert small[-1].item() == SMALL_NUMEL - 1
    assert not dist.is_initialized()


def test_collectives_on_the_fake_group_and_broadcasts_replayed_to_a_later_rank():
    log = BroadcastLog()
    for rank in (1, 0):  # rank 1 (the source) simulated first, as the last pipeline stage is
        with simulated_world(ParallelConfig(), 2, rank, broadcasts=log), simulated_device(MemoryTracker()):
            assert (dist.get_rank(), dist.get_world_size()) == (rank, 2)
            big = torch.empty(SMALL_NUMEL + 1)
            dist.all_reduce(big)  # no data is sent: the call returns
            sums = torch.tensor([4.0, 2.0]) if rank == 1 else torch.zeros(2)
            dist.broadcast(sums, src=1)
            assert sums.tolist() == [4.0, 2.0]  # rank 0 gets what rank 1 sent in its own simulation
            if rank == 0:  # an object from a rank not simulated: no guess
                with pytest.raises(ValueError, match="from rank 1, which the simulation does not run"):
                    dist.broadcast_object_list([None], src=1)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"), simulated_world(ParallelConfig(), 2, 2):
        pass


def test_stand_ins_make_full_length_rollouts_a_pair_per_prompt_and_exact_rm_inputs():
    prompts = stand_in_prompts(2, 512, 512, "{question}\nPlease reason step by step.")
    tok = WordTokenizer(151936)
    assert all(len(p.token_ids) == 512 for p in prompts)
    text = rm_input(prompts[0].question, GOLD, " ".join(["w"] * 512),
                    question_template="{question}\nPlease reason step by step.")
    assert len(tok([text])["input_ids"][0]) == 512 + 512
    outs = StandInEngine().generate([p.token_ids for p in prompts], SamplingParams(max_new_tokens=512))
    assert [len(o.token_ids) for o in outs] == [512, 512]
    verdicts = StandInVerifier().verify_batch([GOLD, GOLD], [o.text for o in outs])
    assert [v.correct for v in verdicts] == [True, False]
    rewrite = StandInAssistant().chat_batch([[{"role": "user", "content": "Correct response:\n" + outs[0].text}]])[0]
    assert len(rewrite.split()) == 512 and StandInVerifier().verify_batch([GOLD], [rewrite])[0].correct is False


def test_the_table_marks_a_phase_off_and_calls_nothing_planned_and_nothing_held_equal():
    off = PhaseCheck("policy_update", 0, 130 * MIB, 100 * MIB, 0, [KindCheck("activations", 130 * MIB, 100 * MIB)])
    empty = PhaseCheck("rollout", 0, 0, 0, 5 * MIB, [KindCheck("overhead", None, 5 * MIB, "not simulated")])
    assert not off.within and empty.within and empty.ratio == 1.0
    text = format_checks([off, empty])
    assert "OFF by more than 15%" in text and "NOT every phase within 15%" in text and "not simulated" in text
