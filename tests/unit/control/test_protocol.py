"""Tests for the control protocol's shapes and framing."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon import errors
from daemon.control.protocol import (
    ERROR_CODES,
    MAX_NESTING,
    OPS,
    History,
    List,
    Logs,
    Ping,
    ProtocolError,
    Send,
    Start,
    check,
    check_names,
    check_nesting,
    decode_request,
    decode_response,
    encode,
    error,
    log_line,
    ok,
)


def _error_classes(cls: type[errors.WorkflowError]) -> list[type[errors.WorkflowError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _error_classes(sub))]


class TestEncode:
    def test_one_line(self) -> None:
        """A message is one JSON line, even when its strings hold newlines."""
        data = encode({"text": "a\nb"})
        assert data.endswith(b"\n") and data.count(b"\n") == 1
        assert msgspec.json.decode(data) == {"text": "a\nb"}

    def test_unknown_values_become_text(self) -> None:
        """Values JSON cannot hold are sent as their str()."""
        assert msgspec.json.decode(encode({"x": ValueError("boom")})) == {"x": "boom"}

    def test_requests_leave_out_defaults(self) -> None:
        """A request built by a client carries its op and only the fields it sets."""
        assert msgspec.json.decode(encode(Ping(id=1))) == {"op": "ping", "id": 1}
        assert msgspec.json.decode(encode(Send(workflow_id="w", event="e", wait=False))) == {
            "op": "send",
            "workflow_id": "w",
            "event": "e",
            "wait": False,
        }

    def test_responses(self) -> None:
        """The response builders give the documented shapes."""
        assert ok(1, [1]) == {"id": 1, "ok": True, "result": [1]}
        assert error("a", "stale", "old") == {
            "id": "a",
            "ok": False,
            "error": {"code": "stale", "message": "old"},
        }
        assert log_line(None, {"event": "x"}) == {"id": None, "ok": True, "log": {"event": "x"}}


class TestDecodeRequest:
    def test_defaults(self) -> None:
        """Optional fields get their documented defaults."""
        assert decode_request(b'{"op": "list"}') == List(limit=100)
        assert decode_request(b'{"op": "history", "workflow_id": "w"}') == History(
            workflow_id="w", limit=1000
        )
        assert decode_request(b'{"op": "logs"}') == Logs(follow=False)
        send = decode_request(b'{"op": "send", "workflow_id": "w", "event": "e"}')
        assert isinstance(send, Send) and send.wait is True and send.input is None

    def test_unknown_fields_are_ignored(self) -> None:
        """A newer client's extra fields do not break an older daemon."""
        assert decode_request(b'{"op": "ping", "id": 2, "colour": "red"}') == Ping(id=2)

    @pytest.mark.parametrize(
        ("line", "code", "words"),
        [
            (b"{", "bad_request", "invalid JSON"),
            (b'"ping"', "bad_request", "JSON object"),
            (b'{"op": 3}', "bad_request", "`op`"),
            (b'{"op": "fly", "id": 7}', "unknown_op", "'fly'"),
            (b'{"op": "start", "id": 7}', "bad_request", "`workflow`"),
            (b'{"op": "start", "id": 7, "workflow": "w", "input": [1]}', "bad_request", "$.input"),
            (
                b'{"op": "send", "id": 7, "workflow_id": "w", "event": "e", "pc": -1}',
                "bad_request",
                "$.pc",
            ),
            (b'{"op": "list", "id": 7, "limit": true}', "bad_request", "$.limit"),
            (b'{"op": "ping", "id": [1]}', "bad_request", "$.id"),
        ],
    )
    def test_errors(self, line: bytes, code: str, words: str) -> None:
        """Bad lines raise ProtocolError with a stable code, a message naming the problem and the id."""
        with pytest.raises(ProtocolError) as caught:
            decode_request(line)
        assert caught.value.code == code and words in caught.value.message
        assert caught.value.id == (7 if b'"id": 7' in line else None)

    @pytest.mark.parametrize("depth", [MAX_NESTING + 1, 200, 900])
    def test_deep_values_are_bad_input(self, depth: int) -> None:
        """A value nested past MAX_NESTING is `bad_input`, with the request's id."""
        deep = b"[" * depth + b"]" * depth
        lines = [
            b'{"op": "send", "id": 7, "workflow_id": "w", "event": "e", "input": %s}',
            b'{"op": "edit", "id": 7, "workflow_id": "w", "set": {"f": %s}}',
            b'{"op": "ping", "id": 7, "unknown": [1, {"x": %s}]}',
        ]
        for line in lines:
            with pytest.raises(ProtocolError) as caught:
                decode_request(line % (deep if b"set" not in line else deep[1:-1]))
            assert caught.value.code == "bad_input" and caught.value.id == 7
            assert f"deeper than {MAX_NESTING} levels" in caught.value.message

    def test_nesting_at_the_limit_and_brackets_in_strings(self) -> None:
        """A value exactly MAX_NESTING deep passes; brackets inside strings do not count."""
        deep = b"[" * MAX_NESTING + b"]" * MAX_NESTING
        line = b'{"op": "send", "workflow_id": "w", "event": "e", "input": %s}' % deep
        assert isinstance(decode_request(line), Send)
        brackets = b'"' + b"[{" * 500 + b'"'
        line = b'{"op": "send", "workflow_id": "w", "event": "e", "input": [%s]}' % brackets
        assert isinstance(decode_request(line), Send)

    @given(
        st.builds(
            Start,
            id=st.none() | st.integers() | st.text(),
            workflow=st.text(),
            # a workflow id is 1-200 characters with no control character (Unicode's Cc)
            workflow_id=st.none()
            | st.text(st.characters(blacklist_categories=["Cc", "Cs"]), min_size=1, max_size=200),
            input=st.none() | st.dictionaries(st.text(), st.integers() | st.text()),
        )
    )
    def test_round_trip(self, req: Start) -> None:
        """What a client encodes, the daemon decodes to the same request."""
        assert decode_request(encode(req)) == req


def _both_checks(line: bytes, req: Send) -> tuple[str, str, object] | None:
    """Return what check_nesting and then check_names raise for `req`, or None."""
    try:
        check_nesting(line, req)
        check_names(req)
    except ProtocolError as e:
        return e.code, e.message, e.id
    return None


#: Names around the limits: empty, 1, MAX_NAME and one over, control characters (C0, DEL, C1).
_NAMES = st.sampled_from(["", "w", "x" * 200, "x" * 201, "a\x1bb", "\x7f", "é\x85", "ok-1"])


class TestSendCheck:
    """`check`, which passes a common `send` in one look, says what the two full checks say."""

    @given(
        workflow_id=_NAMES,
        event=_NAMES,
        thread_id=st.none() | _NAMES,
        depth=st.sampled_from([0, 1, MAX_NESTING - 1, MAX_NESTING, MAX_NESTING + 1, 100]),
        braces=st.booleans(),
    )
    def test_same_outcome_as_the_full_checks(
        self, workflow_id: str, event: str, thread_id: str | None, depth: int, braces: bool
    ) -> None:
        """Every name length, control character and nesting depth: the same error, or none."""
        opening, closing = (b'{"k":', b"}") if braces else (b"[", b"]")
        value = opening * depth + b"1" + closing * depth
        req = Send(id=7, workflow_id=workflow_id, event=event, thread_id=thread_id)
        line = encode(req)[:-2] + b', "input": ' + value + b"}"
        try:
            check(line, req)
            got = None
        except ProtocolError as e:
            got = (e.code, e.message, e.id)
        assert got == _both_checks(line, req)

    def test_brackets_inside_strings_do_not_count(self) -> None:
        """Many brackets in a string pass, as check_nesting lets them."""
        line = b'{"op": "send", "workflow_id": "w", "event": "e", "input": "%s"}' % (b"[" * 500)
        req = decode_request(line)
        assert isinstance(req, Send)
        check(line, req)


class TestCodes:
    def test_every_error_code_is_documented(self) -> None:
        """Each WorkflowError subclass's code is one of ERROR_CODES."""
        codes = {cls.code for cls in _error_classes(errors.WorkflowError)}
        assert codes <= ERROR_CODES

    def test_ops(self) -> None:
        """The ops are exactly the documented verbs."""
        assert {
            "ping",
            "start",
            "send",
            "list",
            "show",
            "history",
            "cancel",
            "logs",
            "reload",
            "backup",
            *("graph", "lint", "goto", "edit", "undo", "retry", "resume", "resume-all", "gc"),
            *("schedules", "schedule_show", "schedule_pause", "schedule_resume"),
            "schedule_trigger",
            "dashboard",
            *("wait", "types"),
        } == OPS

    def test_decode_response(self) -> None:
        """A client reads an object per line and rejects anything else."""
        response: dict[str, Any] = decode_response(b'{"id": 1, "ok": true, "result": null}\n')
        assert response["ok"] is True
        with pytest.raises(ProtocolError):
            decode_response(b"[]")
