"""The outbox on its own (hostctl/serving/outbox.py), over a real ROUTER socket (inproc, with
ROUTER_MANDATORY as the server sets it) and real DEALER clients: per-client order behind a
backlog when ZeroMQ has no room, a gone client's requests aborted once and its frames dropped,
the sweep, and the completion thread's hand-over.  The end-to-end versions are in
test_reliability.py."""

import itertools

import numpy as np
import pytest
import zmq

from ringleader.hostctl.serving import outbox as outbox_module
from ringleader.hostctl.serving.inflight import RequestTable
from ringleader.hostctl.serving.outbox import Outbox
from ringleader.ipc.sampling_params import SamplingParams

_names = itertools.count()


@pytest.fixture
def router():
    """A ROUTER that holds one frame per client (SNDHWM 1): a client that does not read fills it."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"inproc://outbox-{next(_names)}")
    yield sock
    sock.close(0)


@pytest.fixture
def connect(router):
    clients = []

    def connect(identity: bytes) -> zmq.Socket:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, identity)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
        dealer.send(b"hello")  # the ROUTER knows a client once it has heard from it
        assert router.poll(5000)
        assert router.recv_multipart()[0] == identity
        clients.append(dealer)
        return dealer

    yield connect
    for dealer in clients:
        dealer.close(0)


def received(dealer: zmq.Socket) -> list[bytes]:
    out = []
    while dealer.poll(200):
        out.append(dealer.recv())
    return out


def make_outbox(router):
    table, aborted, wakes = RequestTable(), [], []
    box = Outbox(router, table, lambda: wakes.append(1), abort=aborted.append)
    return box, table, aborted, wakes


def add_request(table, client, request_id):
    return table.add(
        client, request_id, prompt_ids=np.zeros(2, np.int32), sampling=SamplingParams(), priority=0
    )


def fill_until_backlogged(box, client: bytes) -> list[bytes]:
    """Frames to `client` until ZeroMQ has no room for one (the outbox starts a backlog)."""
    sent = []
    for i in range(1000):
        sent.append(b"%d" % i)
        box.send(client, sent[-1])
        if box.has_backlog:
            return sent
    raise AssertionError("the socket never ran out of room")


def test_frames_zmq_has_no_room_for_wait_and_later_ones_queue_behind_them(router, connect):
    slow, other = connect(b"a"), connect(b"b")
    box, _, aborted, _ = make_outbox(router)
    sent = fill_until_backlogged(box, b"a")
    box.send(b"a", b"later")  # behind the backlog, though a read may have made room
    box.send(b"b", b"x")  # another client does not wait
    assert received(other) == [b"x"]
    got = received(slow)  # room again: what was held goes out, in order
    for _ in range(50):
        box.retry_backlog()
        got += received(slow)
        if not box.has_backlog:
            break
    assert got == sent + [b"later"] and not box.has_backlog and not aborted


def test_a_client_that_does_not_read_is_gone_once_until_it_is_heard_from(router, connect, monkeypatch):
    monkeypatch.setattr(outbox_module, "MAX_BACKLOG_FRAMES", 3)
    slow = connect(b"slow")
    box, table, aborted, _ = make_outbox(router)
    reqs = [add_request(table, b"slow", i) for i in range(2)]
    for i in range(50):
        box.send(b"slow", b"%d" % i)
        if aborted:
            break
    assert aborted == reqs and box.gone_clients == 1 and not box.has_backlog
    before = received(slow)
    box.send(b"slow", b"dropped")
    assert b"dropped" not in received(slow) and aborted == reqs
    box.heard_from(b"slow")
    box.send(b"slow", b"back")
    assert received(slow) == [b"back"] and box.gone_clients == 0 and before


def test_an_unreachable_client_is_gone_and_forgotten_once_its_requests_ended(router):
    box, table, aborted, _ = make_outbox(router)
    req = add_request(table, b"left", "r")
    box.send(b"left", b"frame")  # never connected: ROUTER_MANDATORY says unreachable
    assert aborted == [req] and box.gone_clients == 1
    box.sweep_gone()
    assert box.gone_clients == 1  # its request has not ended yet
    table.finish(req.handle)
    box.sweep_gone()
    assert box.gone_clients == 0


def test_the_completion_threads_frames_wake_the_frontend_and_go_out_in_order(router, connect):
    a, b = connect(b"a"), connect(b"b")
    box, _, _, wakes = make_outbox(router)
    box.put_many([])
    assert wakes == []
    box.put_many([(b"a", b"1"), (b"b", b"2")])
    box.put_many([(b"a", b"3")])
    assert len(wakes) == 2 and not a.poll(50)  # handed over, not sent: the frontend sends
    box.send_routed()
    assert received(a) == [b"1", b"3"] and received(b) == [b"2"]
