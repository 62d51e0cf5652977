"""The zoo's table and command line (the architectures themselves: tests/frontend)."""

from __future__ import annotations

import dataclasses
import json

from blade_relax.bench import docs, zoo
from blade_relax.bench.zoo import ArchitectureResult, InferenceResult, main, table

ROWS = [
    ArchitectureResult("a", "supported", (5, 17), (100, 90), (100, 100), 1e-7),
    ArchitectureResult("b", "supported", (5, 17), (100, 110), (100, 100), 2e-7),
    ArchitectureResult("c", "refused", reason="c is not supported: no converter for x.default (y)"),
]


def test_ratios_and_standing():
    assert ROWS[0].peak_ratios == (1.0, 0.9) and ROWS[0].at_or_below_eager
    assert not ROWS[1].at_or_below_eager and not ROWS[2].at_or_below_eager


def test_table_one_and_two_a_row():
    one = table(ROWS).splitlines()
    assert one[0] == "| architecture | max rel. error | peak ÷ eager at s = 5, 17 |"
    assert one[2] == "| a | 1.0e-07 | 1.000, 0.900 |"
    assert one[4] == "| c | refused (below) |  |"
    assert one[-1] == "- c: not supported, no converter for x.default (y)"
    two = table(ROWS, per_row=2).splitlines()
    assert two[2] == "| a | 1.0e-07 | 1.000, 0.900 | b | 2.0e-07 | 1.000, 1.100 |"
    assert two[3].count("|") == two[2].count("|")  # the last row padded


def test_architectures_refused_for_one_reason_share_its_line():
    why = "no converter for x.default (y)"
    refused = [
        ArchitectureResult(n, "refused", reason=f"{n} is not supported: {why}") for n in "fg"
    ]
    other = ArchitectureResult("h", "refused", reason="h: export failed")
    lines = table([*refused, other]).splitlines()
    assert lines[-2:] == [f"- f, g: not supported, {why}", "- h: not supported, h: export failed"]


def test_a_failed_run_is_a_row_that_says_so():
    """A length whose run failed has no peak: the row says "failed" instead of a ratio."""
    failed = ArchitectureResult("d", "incorrect", (5, 17), (100, None), (100, 100), None, "s = 17")
    assert failed.peak_ratios == (1.0, None) and not failed.at_or_below_eager
    assert table([failed]).splitlines()[2] == "| d (incorrect) | n/a | 1.000, failed |"


def test_outputs_checked_against_float64_are_marked_and_named():
    checked = ArchitectureResult(
        "e", "supported", (5,), (90,), (100,), 3e-7, float64_checked=("grad:k.bias", "grad:x")
    )
    lines = table([ROWS[0], checked]).splitlines()
    assert lines[2] == "| a | 1.0e-07 | 1.000, 0.900 |"  # unmarked
    assert lines[3] == "| e | 3.0e-07 † | 0.900 |"
    assert lines[-1].startswith("- † gradients whose float32 values are rounding noise (e 2), ")
    assert "at most 10 times as far from it as torch's own float32 result" in lines[-1]
    # A document written before the field existed still reads.
    old = {k: v for k, v in vars(ROWS[0]).items() if k != "float64_checked"}
    assert ArchitectureResult(**old).float64_checked == ()


INFERRED = [
    ArchitectureResult(
        "a",
        "supported",
        (5, 17),
        (100, 90),
        (100, 100),
        1e-7,
        inference=InferenceResult("supported", (80, 90), (100, 100), 3e-7),
    ),
    ArchitectureResult(
        "b",
        "supported",
        (5, 17),
        (100, 100),
        (100, 100),
        2e-7,
        inference=InferenceResult("refused", reason="b is not supported: no converter for z"),
    ),
    ArchitectureResult("c", "supported", (5, 17), (100, 100), (100, 100), 2e-7),
]


def test_the_inference_import_has_two_columns_and_a_line_per_reason():
    lines = table(INFERRED).splitlines()
    assert lines[0].endswith("| peak ÷ eager at s = 5, 17 | inference: error | peak ÷ eager |")
    assert lines[1] == "|---|---:|---|---:|---|"
    assert lines[2] == "| a | 1.0e-07 | 1.000, 0.900 | 3.0e-07 | 0.800, 0.900 |"
    assert lines[3] == "| b | 2.0e-07 | 1.000, 1.000 | refused (below) |  |"
    assert lines[4] == "| c | 2.0e-07 | 1.000, 1.000 | not measured |  |"
    assert lines[-1] == "- b's inference import: refused, b is not supported: no converter for z"
    assert INFERRED[0].inference.at_or_below_eager and not INFERRED[1].inference.at_or_below_eager


def test_a_document_with_inference_reads_back_and_counts_it():
    rows = [dataclasses.asdict(r) for r in INFERRED]
    again = [ArchitectureResult(**json.loads(json.dumps(row))) for row in rows]
    assert again[0].inference == InferenceResult("supported", [80, 90], [100, 100], 3e-7)
    assert again[2].inference is None
    document = {
        "provenance": {"commit": "abc1234", "date": "2026-12-03", "command": "zoo --out f"},
        "results": rows,
    }
    block = docs.architectures_block(document)
    assert "3 match torch (loss and every gradient), 3 of them at or below" in block
    assert "for inference (`input_ids -> logits`), 1 match torch's logits, 1 of them" in block


def test_readme_block_from_a_document():
    document = {
        "provenance": {"commit": "abc1234", "date": "2026-11-29", "command": "zoo --out f"},
        "results": [vars(r) for r in ROWS],
    }
    block = docs.architectures_block(document)
    assert block.startswith(docs.ARCHITECTURES_BEGIN) and block.endswith(docs.ARCHITECTURES_END)
    assert "2 match torch (loss and every gradient), 1 of them at or below" in block
    assert "commit `abc1234` on 2026-11-29 by `zoo --out f`" in block


def test_bad_input_is_one_line(capsys):
    assert main(["--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown architecture(s) nope" in err
    assert set(zoo.REFUSED).isdisjoint(zoo.ARCHITECTURES)


def test_jobs_must_be_positive(capsys):
    assert main(["--only", "llama", "--jobs", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--jobs must be at least 1, not 0" in err
