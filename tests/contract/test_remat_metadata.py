"""The remat metadata: one dataclass, its JSON and its version, for the writer and the reader."""

from __future__ import annotations

import json

import pytest

from blade_relax.contract import (
    REMAT_FORMAT,
    PlanNode,
    RematFormatError,
    RematMetadata,
    RematSlot,
)


def _metadata() -> RematMetadata:
    return RematMetadata(
        function="f",
        dims=("b", "s"),
        exact=False,
        notes=("control flow (If)",),
        points=4,
        exprs=("(4 * s)", "(8 * (b * s))", "1"),
        storages=((0, 0, 4), (1, 1, 3)),
        slots=(
            RematSlot(
                name="t",
                regen="f_remat0",
                nbytes=1,
                cost=2,
                regen_peak=0,
                start=2,
                site=3,
                plan=(PlanNode(0, (("a", 0), ("s", 1))),),
            ),
        ),
    )


def test_json_text_is_compact_with_keys_in_the_documented_order():
    assert _metadata().to_json() == (
        '{"format":"blade_relax.remat/2","function":"f","dims":["b","s"],"exact":false,'
        '"notes":["control flow (If)"],"points":4,"exprs":["(4 * s)","(8 * (b * s))","1"],'
        '"storages":[[0,0,4],[1,1,3]],"slots":[{"name":"t","regen":"f_remat0","bytes":1,'
        '"cost":2,"regen_peak":0,"start":2,"site":3,"plan":[[0,[["a",0],["s",1]]]]}]}'
    )


def test_json_round_trip():
    meta = _metadata()
    assert RematMetadata.from_json(meta.to_json()) == meta
    assert RematMetadata.from_json(meta.to_json().encode()) == meta
    assert RematMetadata.from_dict(json.loads(meta.to_json())).to_json() == meta.to_json()


def test_exact_and_notes_may_be_left_out():
    raw = _metadata().to_dict()
    del raw["exact"], raw["notes"]
    meta = RematMetadata.from_dict(raw)
    assert meta.exact is False and meta.notes == ()


def test_another_version_is_refused_with_what_to_do():
    raw = {**_metadata().to_dict(), "format": "blade_relax.remat/1"}
    with pytest.raises(RematFormatError, match="recompile the module") as err:
        RematMetadata.from_dict(raw)
    assert "'blade_relax.remat/1'" in str(err.value) and REMAT_FORMAT in str(err.value)
    with pytest.raises(ValueError, match="format None"):
        RematMetadata.from_dict({"function": "f"})


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.pop("points"),
        lambda m: m["slots"][0].pop("regen"),
        lambda m: m.update(storages=[[0, 1]]),
        lambda m: m.update(points="many"),
    ],
)
def test_malformed_metadata_is_refused(change):
    raw = _metadata().to_dict()
    change(raw)
    with pytest.raises(RematFormatError, match="malformed remat metadata"):
        RematMetadata.from_dict(raw)
