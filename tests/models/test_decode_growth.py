"""Response slots that grow with the decode (models/slots.py, rollout.native.response_chunk), on CPU: a decode whose
slots start at 4 and double over 13 tokens samples what the preallocated decode samples, for both families, with
the static decoder, the eager `StepDecoder` and glm52's routing records; the buffers grow at the steps the schedule
says and a response that stops early keeps the first chunk; the compiled step is not compiled again after a growth;
`longstraw plan` counts the buffers a full-length decode ends with, and the old copy its last growth holds."""

import contextlib
import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from conftest import ids, random_model, rel_err
from longstraw_cli.models.core import StepDecoder
from longstraw_cli.models.glm52.routing import RoutingRecord, RoutingReplay
from longstraw_cli.models.slots import ResponseSlots, response_capacities
from longstraw_cli.plan import plan
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["qwen36_tiny", "glm52_tiny"]
PROMPT, R, G, CHUNK = 50, 13, 3, 4
# the static step's response attention sums over all its slots with BLAS kernels whose order of summation depends on
# their count, so slots of 4, 8, 13 against 13 throughout round apart in the last bits (as today's preallocated
# decode does between max_new_tokens=13 and 16: qwen36_tiny 1.4e-16 in fp64, 8e-8 in fp32); the eager path reads only
# the filled slots and is exact
ROUNDING = {torch.float64: 1e-14, torch.float32: 1e-6}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.itemsize for t in tensors)


def rollouts(model, resident, chunks, routing=None, stop_token_ids=(), stop_check_every=16):
    cfg = SamplingConfig(max_new_tokens=R, stop_token_ids=stop_token_ids)
    return [generate(model, resident, G, cfg, torch.Generator().manual_seed(4),
                     NativeConfig(response_chunk=chunk, stop_check_every=stop_check_every), routing=routing)
            for chunk in chunks]


def decode(decoder, start: int, stop: int) -> list[int]:
    """Steps [start, stop) under the rollout loop's growth rule; -> the capacity each step ran at."""
    capacities = []
    for step in range(start, stop):
        if step == decoder.capacity:
            decoder.grow()
        decoder.tokens_B.copy_(decoder.step().argmax(-1))
        capacities.append(decoder.capacity)
    return capacities


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("name", FAMILIES)
def test_grown_slots_sample_what_preallocated_slots_sample(name, dtype):
    model = random_model(name, dtype)
    resident = model.capture(ids(PROMPT, 0), block_size=16)
    grown, whole = rollouts(model, resident, (CHUNK, R))
    assert [r.tolist() for r in grown.responses] == [r.tolist() for r in whole.responses]
    assert max(rel_err(a, b) for a, b in zip(grown.logprobs, whole.logprobs)) < ROUNDING[dtype]
    # the eager path over the layers' `decode_step` reads the filled slots only: bit for bit
    model.decoder = functools.partial(StepDecoder, model)
    grown, whole = rollouts(model, resident, (CHUNK, R))
    assert [r.tolist() for r in grown.responses] == [r.tolist() for r in whole.responses]
    assert all(torch.equal(a, b) for a, b in zip(grown.logprobs, whole.logprobs))


def test_routing_records_grow_with_the_slots():
    """glm52's decode writes each token's experts and DSA selection into records that grow with its slots: the
    same records as with all slots preallocated (fp64: no choice near a tie moves)."""
    model = random_model("glm52_tiny", torch.float64, seed=1)
    resident = model.capture(ids(PROMPT, 2), block_size=16)
    grown, whole = rollouts(model, resident, (CHUNK, R), routing=RoutingReplay())
    assert [r.tolist() for r in grown.responses] == [r.tolist() for r in whole.responses]
    assert grown.routing.experts.keys() == whole.routing.experts.keys()
    for a, b in zip(grown.routing.tensors(), whole.routing.tensors()):
        assert a.shape[1] == R and torch.equal(a, b)


@pytest.mark.parametrize("name", FAMILIES)
@torch.no_grad()
def test_slots_double_at_their_capacity_and_keep_what_was_written(name):
    model = random_model(name)
    resident = model.capture(ids(PROMPT, 0), block_size=16)
    decoder = model.decoder(resident, G, R, response_chunk=CHUNK)
    per_slot = nbytes(t for slots in decoder.response_slots() for t in slots.tensors()) // CHUNK
    assert decoder.capacity == CHUNK and per_slot > 0
    # a short response: its slots and the step's validity mask stay at the first chunk
    assert decode(decoder, 0, 3) == [4, 4, 4] and decoder.slots_S.numel() == 4
    assert nbytes(t for slots in decoder.response_slots() for t in slots.tensors()) == CHUNK * per_slot
    written = [t.clone() for slots in decoder.response_slots() for t in slots.tensors()]
    assert decode(decoder, 3, R) == [4, 8, 8, 8, 8, 13, 13, 13, 13, 13]
    assert response_capacities(R, CHUNK) == [4, 8, 13] and decoder.slots_S.numel() == 13
    for old, new in zip(written, (t for slots in decoder.response_slots() for t in slots.tensors())):
        assert new.shape[1] == R and torch.equal(new[:, :3], old[:, :3])
    assert nbytes(t for slots in decoder.response_slots() for t in slots.tensors()) == R * per_slot


def test_a_short_rollout_records_the_first_chunk_only(monkeypatch):
    """Every response stops at its first token: the routing record (like the decoder's slots) never grows past its
    first chunk, and the rollout keeps the slots its two steps wrote."""
    model = random_model("glm52_tiny", torch.float64, seed=1)
    resident = model.capture(ids(PROMPT, 2), block_size=16)
    every = tuple(range(model.config.vocab_size))
    growths, grow = [], RoutingRecord.grow

    def counted(record, capacity):
        growths.append(capacity)
        grow(record, capacity)

    monkeypatch.setattr(RoutingRecord, "grow", counted)
    stopped, = rollouts(model, resident, (CHUNK,), RoutingReplay(), stop_token_ids=every, stop_check_every=2)
    assert stopped.decode_steps == 2 and all(len(r) == 1 for r in stopped.responses)
    assert growths == [] and all(t.shape[1] == stopped.decode_steps for t in stopped.routing.tensors())
    # the same rollout to the end grows it at each chunk (what the check above would see)
    rollouts(model, resident, (CHUNK,), RoutingReplay())
    assert growths == response_capacities(R, CHUNK)[1:]


@pytest.mark.parametrize("name", ["qwen36_tiny", "glm52_tiny"])
@torch.no_grad()
def test_a_growth_does_not_compile_the_step_again(name):
    """The capacity is a dynamic size of the compiled step (as the page count, tests/models/test_decode_shapes.py):
    dynamo traces the step (qwen36) or its layer function (glm52) once, at the first chunk, and its graphs serve
    the grown slots (counting backend, no inductor)."""
    torch._dynamo.reset()
    try:
        model = random_model(name, torch.float32, num_hidden_layers=4)
        resident = model.capture(ids(PROMPT, 0), block_size=16)
        eager, compiled = (model.decoder(resident, 2, R, response_chunk=CHUNK) for _ in range(2))
        counter = CompileCounter()
        step = compiled.compiled(backend=counter)
        frames = []
        for i in range(R):
            if i == eager.capacity:
                eager.grow()
                compiled.grow()
            expected = eager.step()
            assert torch.equal(step(), expected)
            eager.tokens_B.copy_(expected.argmax(-1))
            compiled.tokens_B.copy_(expected.argmax(-1))
            frames.append(counter.frame_count)
        assert eager.capacity == R and frames == frames[:1] * R, frames
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("name, replay_routing", [("qwen36_tiny", False), ("glm52_tiny", False),
                                                  ("glm52_tiny", True)])
@torch.no_grad()
def test_plan_counts_the_buffers_a_full_length_decode_ends_with(name, replay_routing):
    """`decode_buffers` is what a decode of R tokens holds at its end (qwen36: the K/V slots and the per-response
    GDN states; glm52: latent, rope and index slots; `routing_records` the records grown beside them), and
    `decode_growth` the largest single buffer at the capacity before R: the old copy the last growth holds."""
    model = random_model(name, torch.float32)
    resident = model.capture(ids(PROMPT, 0), block_size=16)
    p = plan(name, prompt_tokens=PROMPT, group_size=G, response_tokens=R, dtype="float32", response_chunk=CHUNK,
             replay_routing=replay_routing)
    decoder = model.decoder(resident, G, R, response_chunk=CHUNK)
    routing = RoutingReplay() if replay_routing else None
    record = routing.new_record(model, resident, G, decoder.capacity) if routing else None
    largest_old = 0
    with routing.recording(record, model) if routing else contextlib.nullcontext():
        for step in range(R):
            if step == decoder.capacity:
                olds = [t for slots in decoder.response_slots() for t in slots.tensors()]
                largest_old = max(nbytes([t]) for t in olds + (record.tensors() if record else []))
                del olds
                decoder.grow()
                if record:
                    record.grow(decoder.capacity)
            decoder.tokens_B.copy_(decoder.step().argmax(-1))
    held = [t for slots in decoder.response_slots() for t in slots.tensors()]
    assert all(t.shape[1] == R for t in held)
    # qwen36's GDN layers hold each response's conv window and recurrent state beside the slots
    recurrent = [t for layer in decoder.layers if not isinstance(layer, ResponseSlots) for t in layer.tensors()]
    assert p["decode_buffers"] == nbytes(held) + nbytes(recurrent)
    if record:
        assert p["routing_records"] == record.nbytes()
    assert p["decode_growth"] == largest_old > 0


def test_response_chunk_setting_is_checked(tmp_path):
    from conftest import composed
    from longstraw_cli.config import ConfigError, train_config

    def native(*overrides):
        return train_config(composed([f"run_dir={tmp_path}", *overrides])).rollout.native

    assert native().response_chunk == NativeConfig().response_chunk == 1024
    assert native("rollout.native.response_chunk=64").response_chunk == 64
    for bad in (0, -3, 1.5, True):
        with pytest.raises((ValueError, ConfigError), match="response_chunk"):
            NativeConfig(response_chunk=bad)
