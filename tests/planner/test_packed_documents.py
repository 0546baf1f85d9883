"""The planner knows rows of packed documents: it charges attention by the documents' lengths (the sum of
their squares, read from the job's data), times the layer on rows like the data's, and keeps those blocks
apart from plain rows' blocks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from slidedp.config import load_job
from slidedp.launch.planning import document_load, plan_job
from slidedp.model.config import named_shape
from slidedp.planner import REFERENCE_CALIBRATION, Workload, costs, measure, predict_step
from slidedp.planner.workload import DocumentLoad
from slidedp.data.documents import Documents
from slidedp.data.packing import DocBatches, PackedRows
from slidedp.stepplan import StepPlan

from pipeline.harness import TINY


def test_the_load_is_the_sum_of_squared_document_lengths_per_token():
    load = DocumentLoad.of([3, 5, 8, 10, 6], [0, 2, 3, 5])  # rows [3, 5], [8], [10, 6]
    assert load.attended_len == (9 + 25 + 64 + 100 + 36) / 32
    assert load.sample == ((3, 5), (8,), (10, 6))
    assert DocumentLoad.of([16, 16], [0, 1, 2]).attended_len == 16.0  # one document per row: the row's length
    assert DocumentLoad.from_dict(load.to_dict()) == load
    spread = DocumentLoad.of([4] * 400, list(range(0, 401, 4)), sample_rows=5)  # 100 rows: 5 spread over them
    assert len(spread.sample) == 5
    assert DocumentLoad(883.7, ()).key == "packed documents, 880 attended"
    assert DocumentLoad(8.26, ()).key == "packed documents, 8.3 attended"


def test_packed_rows_give_their_documents_lengths_with_padding_in_the_last():
    lengths = [9, 14, 6, 5, 20]  # tokens; a document fills tokens - 1 positions
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    docs = Documents(np.arange(offsets[-1]) % 50, np.ones(offsets[-1], dtype=np.uint8), offsets)
    rows = PackedRows.build(docs, 24, packed=True)
    got, row_offsets = rows.document_lengths()
    per_row = [got[row_offsets[r]:row_offsets[r + 1]].tolist() for r in range(len(row_offsets) - 1)]
    assert all(sum(r) == 24 for r in per_row)  # every row's positions, padding included
    padding = [24 - sum(r) for r in (rows.docs.lengths()[rows.row_docs[row_offsets[i]:row_offsets[i + 1]]] - 1
                                     for i in range(len(per_row)))]
    assert sorted(n for r, pad in zip(per_row, padding) for n in r[:-1] + [r[-1] - pad]) == sorted(
        n - 1 for n in lengths)  # each document's positions, the row's padding on its last
    load = document_load(DocBatches(rows, 1))
    assert load is not None and load.attended_len == sum(n * n for r in per_row for n in r) / (len(per_row) * 24)
    padded = PackedRows.build(docs, 24, packed=False)
    assert document_load(DocBatches(padded, 1)) is None  # one document per row: plain causal rows


def test_packed_rows_cost_less_attention_than_plain_rows_of_the_same_tokens():
    cfg = named_shape("qwen3-4b", 512)
    plain = Workload(cfg, global_batch=2, seq_len=16384, world=1, micro_batch=1, clip=True)
    packed = dataclasses.replace(plain, documents=DocumentLoad(900.0, ((16384,),)))
    assert packed.attended_len == 900.0 and plain.attended_len == 16384.0
    q = cfg.num_heads * cfg.head_dim
    assert (costs.layer_forward_flops_per_token(cfg, plain.attended_len)
            - costs.layer_forward_flops_per_token(cfg, packed.attended_len)) == 2.0 * (16384 - 900) * q
    choices = StepPlan(micro_batch=1)
    plain_busy = predict_step(plain, choices, REFERENCE_CALIBRATION)[0]["device"]
    packed_busy = predict_step(packed, choices, REFERENCE_CALIBRATION)[0]["device"]
    assert packed_busy < 0.8 * plain_busy  # attention is most of a 16K row's FLOPs


def test_the_blocks_of_packed_rows_are_measured_on_rows_like_the_data(monkeypatch):
    cfg = named_shape("tiny", 512)
    load = DocumentLoad.of([5, 3, 8, 16, 10, 6], [0, 3, 4, 6])  # rows of 16 positions
    blocks = measure.measure_blocks(cfg, 16, "fp32", False, [(2, 0, 16)], 2, device="cpu", repeat=1,
                                    device_name="cpu", documents=load)
    assert blocks.shape == measure.shape_key(cfg, 16, "fp32", False, load) != measure.shape_key(cfg, 16, "fp32", False)
    assert "packed documents, 10 attended" in blocks.shape  # 490 / 48 = 10.2
    attns = measure.pass_attention(cfg, 2, 16, 2, "cpu", measure_dtype(), load)
    assert [a.backend for a in attns] == ["mask", "mask"]  # CPU: the dense mask; CUDA bf16: varlen
    documents = [a.documents.tolist() for a in attns]
    assert documents[0] == [[0] * 5 + [1] * 3 + [2] * 8, [0] * 16]  # the sampled rows in turn
    assert documents[1] == [[0] * 10 + [1] * 6, [0] * 5 + [1] * 3 + [2] * 8]
    with pytest.raises(measure.MeasureError, match="do not fill rows of 32 positions"):
        measure.pass_attention(cfg, 2, 32, 1, "cpu", measure_dtype(), load)


def measure_dtype():
    import torch

    return torch.float32


def test_plan_job_hands_the_documents_to_the_planner():
    job = load_job(TINY, ['runtime.device="cuda"', "train.global_batch=8", "plan.micro_batch=2"])
    plain = plan_job(job, REFERENCE_CALIBRATION)
    packed = plan_job(job, REFERENCE_CALIBRATION, documents=DocumentLoad(3.0, ((job.train.seq_len,),)))
    assert packed.plan.workload.documents is not None and plain.plan.workload.documents is None
    assert dict(packed.plan.busy_s)["device"] < dict(plain.plan.busy_s)["device"]
