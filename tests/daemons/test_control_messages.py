"""The control plane's typed requests: JSON on the wire, checked against their type on arrival."""

from __future__ import annotations

import json

import pytest

from slidedp.protocol import (CONTROL, GRAD_SLOTS, REQUESTS, Attach, Checkpoint, ControlError, Request, control,
                              decode, decode_control, encode_control)


def test_every_request_survives_the_wire():
    samples = {"attach": {"world": 2, "pid": 7, "hyper": {"lr": 0.1}}, "checkpoint": {"dir": "/ck", "extra_files": ["t"]},
               "restore": {"path": "/ck/step-3", "token": 5}, "create": {"source": "hf", "path": "/m"},
               "destroy": {"force": True}, "detach": {"token": 9}}
    for kind in REQUESTS:
        req = control(kind, **samples.get(kind, {}))
        wire = decode(encode_control(req).encode(), (Request,))
        assert wire.name == kind and isinstance(wire, Request)
        assert json.loads(wire.text) == json.loads(json.dumps(req.__dict__))  # plain JSON, never pickle
        assert decode_control(wire) == req and type(req) is CONTROL[kind]


def test_defaults_are_defined_once():
    assert control("attach", world=1, pid=1).grad_slots == GRAD_SLOTS == 3
    assert Checkpoint(dir="/x").keep == 3 and Checkpoint(dir="/x").dtype == "bf16"


def test_arguments_that_make_no_request_are_named():
    with pytest.raises(ControlError, match=r"^missing argument 'world'$"):
        control("attach", pid=1)
    with pytest.raises(ControlError, match=r"^attach: unknown argument\(s\) 'grad_slot'$"):
        control("attach", world=1, pid=1, grad_slot=4)
    with pytest.raises(ControlError, match=r"^unknown request 'reboot'$"):
        control("reboot")
    with pytest.raises(ControlError, match="request arguments must be a JSON object"):
        decode_control(Request(REQUESTS.index("status"), "[1]"))
    assert decode_control(Request(REQUESTS.index("status"), "")) == control("status")
    assert Attach(world=1, pid=2) == control("attach", world=1, pid=2)
