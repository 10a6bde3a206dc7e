"""Malformed, oversized and out-of-order messages get error replies; everyone else keeps being served."""

import json
import random
import threading

import pytest
from hypothesis import given, settings, strategies as st

from cotenant.coordinator import client, protocol
from cotenant.coordinator.protocol import ProtocolError
from coordinator_harness import Node, connect_raw

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_are_either_a_valid_request_or_a_protocol_error(data):
    try:
        request = protocol.parse_request(data)
    except ProtocolError as error:
        assert error.code in (protocol.BAD_JSON, protocol.BAD_REQUEST, protocol.UNSUPPORTED_VERSION,
                              protocol.UNKNOWN_OP, protocol.TOO_LARGE)
        assert error.message
    else:
        assert request.op in protocol.SCHEMA


@settings(max_examples=300, deadline=None)
@given(op=st.sampled_from(sorted(protocol.SCHEMA) + ["bogus"]), fields=st.dictionaries(
    st.sampled_from(["role", "device", "name", "memory_cap", "job", "share", "command", "since", "extra"]),
    json_values, max_size=4), request_id=st.integers(-2, 2**64), version=st.sampled_from([1, 1, 1, 0, 2, "1"]))
def test_structured_but_wrong_requests_are_refused_with_a_code(op, fields, request_id, version):
    message = {"v": version, "id": request_id, "op": op, **fields}
    try:
        request = protocol.parse_request(json.dumps(message).encode())
    except ProtocolError as error:
        assert error.code != protocol.INTERNAL
        return
    # Accepted: then it really matches the schema.
    schema = protocol.SCHEMA[request.op]
    assert set(request.args) <= set(schema)
    assert all(name in request.args for name, (_, required) in schema.items() if required)


def test_oversized_request_is_refused():
    with pytest.raises(ProtocolError) as error:
        protocol.parse_request(b'{"v":1,"id":1,"op":"status","x":"' + b"a" * protocol.MAX_MESSAGE_BYTES + b'"}')
    assert error.value.code == protocol.TOO_LARGE


@pytest.fixture(scope="module")
def node():
    n = Node()
    n.start_coordinator()
    n.start_job("guaranteed", "g", hold_mib=32)
    yield n
    n.close()


def _exchange(sock, reader, data):
    sock.sendall(data)
    return json.loads(reader.readline())


def _malformed_messages(rng):
    """Seeded garbage: broken JSON, wrong types, unknown ops and fields, bad versions, binary noise."""
    valid = {"v": 1, "op": "status"}
    while True:
        kind = rng.randrange(8)
        if kind == 0:
            yield bytes(rng.randrange(1, 256) for _ in range(rng.randrange(1, 200))).replace(b"\n", b" ") + b"\n"
        elif kind == 1:
            yield b'{"v": 1, "id": ' + str(rng.randrange(10**6)).encode() + b', "op": "stat\n'
        elif kind == 2:
            yield json.dumps([1, 2, 3]).encode() + b"\n"
        elif kind == 3:
            yield json.dumps({**valid, "op": rng.choice(["", "STATUS", "rm -rf", "register2"])}).encode() + b"\n"
        elif kind == 4:
            yield json.dumps({**valid, "v": rng.choice([0, 2, "1", None, 1.0000001])}).encode() + b"\n"
        elif kind == 5:
            yield json.dumps({"v": 1, "op": "set_share", "job": "g", "share": rng.choice([-1, 2, "half", None, True])}).encode() + b"\n"
        elif kind == 6:
            yield json.dumps({"v": 1, "op": "register", "role": rng.choice(["boss", 1, None]), "device": -1}).encode() + b"\n"
        else:
            yield b'{"v":1,"id":1,"op":"status","nested":' + b"[" * 5000 + b"]" * 5000 + b"}\n"


def test_seeded_garbage_gets_error_replies_while_another_client_is_served(node):
    rng = random.Random(1234)
    stop = threading.Event()
    served = []

    def well_behaved():
        with client.CoordinatorClient(node.socket) as c:
            while not stop.is_set():
                served.append(len(c.request("status")["jobs"]))

    other = threading.Thread(target=well_behaved)
    other.start()
    try:
        sock = connect_raw(node.socket)
        reader = sock.makefile("rb")
        garbage = _malformed_messages(rng)
        for _ in range(300):
            reply = _exchange(sock, reader, next(garbage))
            assert reply["ok"] is False
            assert reply["error"]["code"] in (protocol.BAD_JSON, protocol.BAD_REQUEST, protocol.UNKNOWN_OP,
                                              protocol.UNSUPPORTED_VERSION, protocol.OUT_OF_ORDER)
            assert reply["error"]["message"]
        # The same connection still works after all that.
        reply = _exchange(sock, reader, json.dumps(protocol.request("status", 10**9)).encode() + b"\n")
        assert reply["ok"] is True
        sock.close()
    finally:
        stop.set()
        other.join(10)
    assert served and all(n == 1 for n in served)


def test_oversized_message_gets_an_error_and_the_coordinator_keeps_serving(node):
    sock = connect_raw(node.socket)
    reader = sock.makefile("rb")
    sock.sendall(b'{"v":1,"id":1,"op":"status","pad":"' + b"x" * (2 * protocol.MAX_MESSAGE_BYTES) + b'"}\n')
    reply = json.loads(reader.readline())
    assert reply["ok"] is False and reply["error"]["code"] == protocol.TOO_LARGE
    assert reader.readline() == b""  # that connection is closed
    sock.close()
    assert node.status()["jobs"][0]["name"] == "g"


def test_out_of_order_requests_get_error_replies(node):
    sock = connect_raw(node.socket)
    reader = sock.makefile("rb")
    assert _exchange(sock, reader, json.dumps(protocol.request("status", 5)).encode() + b"\n")["ok"]
    repeated = _exchange(sock, reader, json.dumps(protocol.request("status", 5)).encode() + b"\n")
    assert repeated["error"]["code"] == protocol.OUT_OF_ORDER
    backwards = _exchange(sock, reader, json.dumps(protocol.request("hello", 3)).encode() + b"\n")
    assert backwards["error"]["code"] == protocol.OUT_OF_ORDER
    # Unregistering a job this process never registered is out of order too.
    unregister = _exchange(sock, reader, json.dumps(protocol.request("unregister", 6)).encode() + b"\n")
    assert unregister["error"]["code"] == protocol.OUT_OF_ORDER
    assert _exchange(sock, reader, json.dumps(protocol.request("status", 7)).encode() + b"\n")["ok"]
    sock.close()


def test_peer_that_disconnects_mid_message_does_not_disturb_the_coordinator(node):
    for _ in range(20):
        sock = connect_raw(node.socket)
        sock.sendall(b'{"v":1,"id":1,"op":"sta')
        sock.close()
    assert node.status()["jobs"][0]["name"] == "g"
