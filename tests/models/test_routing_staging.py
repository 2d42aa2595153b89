"""Routing records kept in host memory and staged (models/glm52/routing.py `StagedRows`, `staged_recording`,
`to_host`) on glm52_tiny, fp64, CPU: the compute device sees only the rows in use, the slots of the current call
(one response while it replays, a score batch while it scores), and what it sees equals the full record's rows;
forcing staged rows gives the log-probs of forcing the full record bit for bit; recording at scoring through staged
rows fills the host record as recording into it directly does. The CPU has no second device: the staging target is
a parameter (`StagedRows(..., device)`), and the bytes on it are the staged tensors' (`StagedRows.device_bytes`)."""

import pytest
import torch

from conftest import ids, random_model
from longstraw_cli.models.glm52.routing import (
    RoutingRecord,
    RoutingReplay,
    StagedRows,
    forcing,
    record_bytes,
    recording,
    staged_recording,
    to_host,
)
from longstraw_cli.rollout.native import SamplingConfig, generate

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, RESPONSE, G = 50, 14, 3
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup():
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = random_model("glm52_tiny", torch.float64, seed=1)
    resident = model.capture(ids(PROMPT, 2), block_size=16)
    routing = RoutingReplay(force=True)
    ro = generate(model, resident, G, SamplingConfig(max_new_tokens=RESPONSE), torch.Generator().manual_seed(3),
                  routing=routing)
    torch.set_num_threads(num_threads)
    return model, resident, routing, ro


def rows_of(record: RoutingRecord, rows: slice, slots: torch.Tensor) -> dict:
    return {**{("expert", i): t[rows].index_select(1, slots) for i, t in record.experts.items()},
            **{("dsa", i): t[rows].index_select(1, slots) for i, t in record.selections.items()}}


def test_a_cpu_record_stays_where_it_is():
    model = random_model("glm52_tiny", torch.float64, seed=1)
    record = RoutingRecord.empty(model, G, RESPONSE, first=PROMPT - 1)
    assert to_host(record) is record


def test_replaying_response_i_stages_only_its_rows_and_forces_as_the_full_record(setup):
    model, resident, routing, ro = setup
    record = ro.routing
    per_token = record_bytes(model.config, 1, 1)
    for i, response in enumerate(ro.responses):
        with forcing(model, record.rows(slice(i, i + 1))):
            want = model.logprobs(resident, response)
        with routing.replaying(record, model, slice(i, i + 1)):
            got = model.logprobs(resident, response)
            staged = routing.staged
            # one call: response i's slots 0 .. len - 1, every layer, nothing of another response
            assert staged.device_bytes() == len(response) * per_token
            slots = torch.arange(len(response))
            want_rows = rows_of(record, slice(i, i + 1), slots)
            assert staged.staged.keys() == want_rows.keys()
            assert all(torch.equal(staged.staged[key], want_rows[key]) for key in want_rows)
        assert routing.staged is None
        assert torch.equal(got, want)
    routing.metrics()


def test_scoring_stages_the_score_batch_rows(setup):
    model, resident, routing, ro = setup
    batch = torch.nn.utils.rnn.pad_sequence(ro.responses[:2], batch_first=True)
    with routing.scoring(ro.routing, model, slice(0, 2)):
        model.logprobs(resident, batch)
        assert routing.staged.device_bytes() == record_bytes(model.config, 2, batch.shape[1])


def test_staged_slots_are_the_calls_and_kept_while_it_asks_for_them(setup):
    model, _, _, ro = setup
    record, layer = ro.routing, next(iter(ro.routing.experts))
    staged = StagedRows(record, slice(1, 3), CPU)
    first = record.first
    # any slots, in any order: the record's rows at them
    positions_T = torch.tensor([first + 5, first + 2, first + 3])
    ids_BTk = staged.expert_ids(layer, positions_T)
    assert torch.equal(ids_BTk, record.experts[layer][1:3].index_select(1, positions_T - first))
    # the same call's other layers and a second read: staged once
    assert staged.expert_ids(layer, positions_T) is ids_BTk
    assert staged.expert_ids(layer, positions_T.clone()) is ids_BTk
    # a call at other positions (the next block of a response) drops what the last one staged
    block_T = torch.arange(first + 6, first + 10)
    assert torch.equal(staged.expert_ids(layer, block_T), record.experts[layer][1:3, 6:10])
    assert staged.device_bytes() == 2 * 4 * record.experts[layer].shape[2] * record.experts[layer].itemsize
    full = next(iter(record.selections))
    assert torch.equal(staged.selection(full, block_T), record.selections[full][1:3, 6:10])


def test_recording_at_scoring_through_staged_rows_fills_the_host_record(setup):
    model, resident, _, ro = setup
    batch = torch.nn.utils.rnn.pad_sequence(ro.responses, batch_first=True)
    direct = RoutingRecord.empty(model, G, batch.shape[1], first=resident.num_tokens)
    through = RoutingRecord.empty(model, G, batch.shape[1], first=resident.num_tokens)
    with torch.no_grad():
        # score batches of 2, as transaction.score makes them
        for start in range(0, G, 2):
            rows = slice(start, min(G, start + 2))
            with recording(model, direct, rows):
                want = model.logprobs(resident, batch[rows])
            with staged_recording(model, through, rows, CPU):
                got = model.logprobs(resident, batch[rows])
            assert torch.equal(got, want)
    assert all(torch.equal(direct.experts[i], through.experts[i]) for i in direct.experts)
    assert all(torch.equal(direct.selections[i], through.selections[i]) for i in direct.selections)
