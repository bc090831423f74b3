"""The outbox on its own (hostctl/serving/outbox.py), over a stand-in ROUTER socket: per-client
order behind a backlog, a gone client's requests aborted once and its frames dropped, the sweep,
and the completion thread's hand-over.  The end-to-end versions are in test_reliability.py."""

import errno

import numpy as np
import zmq

from ringleader.hostctl.serving import outbox as outbox_module
from ringleader.hostctl.serving.inflight import RequestTable
from ringleader.hostctl.serving.outbox import Outbox
from ringleader.ipc.sampling_params import SamplingParams


class StandInRouter:
    """Sends while it has room; a client in `unreachable` raises what ROUTER_MANDATORY raises."""

    def __init__(self):
        self.sent: list[tuple[bytes, bytes]] = []
        self.room = True
        self.unreachable: set[bytes] = set()

    def send_multipart(self, parts, flags=0):
        client, frame = parts
        if client in self.unreachable:
            raise zmq.ZMQError(errno.EHOSTUNREACH)
        if not self.room:
            raise zmq.Again()
        self.sent.append((client, frame))


def make_outbox():
    socket, table, aborted, wakes = StandInRouter(), RequestTable(), [], []
    box = Outbox(socket, table, lambda: wakes.append(1), abort=aborted.append)
    return box, socket, table, aborted, wakes


def add_request(table, client, request_id):
    return table.add(
        client, request_id, prompt_ids=np.zeros(2, np.int32), sampling=SamplingParams(), priority=0
    )


def test_frames_zmq_has_no_room_for_wait_and_later_ones_queue_behind_them():
    box, socket, _, _, _ = make_outbox()
    socket.room = False
    box.send(b"a", b"1")
    socket.room = True
    box.send(b"a", b"2")  # behind "1", though the socket has room again
    box.send(b"b", b"x")  # another client does not wait
    assert socket.sent == [(b"b", b"x")] and box.has_backlog
    box.retry_backlog()
    assert socket.sent == [(b"b", b"x"), (b"a", b"1"), (b"a", b"2")] and not box.has_backlog


def test_a_client_that_does_not_read_is_gone_once_until_it_is_heard_from(monkeypatch):
    monkeypatch.setattr(outbox_module, "MAX_BACKLOG_FRAMES", 3)
    box, socket, table, aborted, _ = make_outbox()
    reqs = [add_request(table, b"slow", i) for i in range(2)]
    socket.room = False
    for i in range(6):
        box.send(b"slow", b"%d" % i)
    assert aborted == reqs and box.gone_clients == 1 and not box.has_backlog
    socket.room = True
    box.send(b"slow", b"dropped")
    assert socket.sent == [] and aborted == reqs
    box.heard_from(b"slow")
    box.send(b"slow", b"back")
    assert socket.sent == [(b"slow", b"back")] and box.gone_clients == 0


def test_an_unreachable_client_is_gone_and_forgotten_once_its_requests_ended():
    box, socket, table, aborted, _ = make_outbox()
    req = add_request(table, b"left", "r")
    socket.unreachable.add(b"left")
    box.send(b"left", b"frame")
    assert aborted == [req] and box.gone_clients == 1
    box.sweep_gone()
    assert box.gone_clients == 1  # its request has not ended yet
    table.finish(req.handle)
    box.sweep_gone()
    assert box.gone_clients == 0


def test_the_completion_threads_frames_wake_the_frontend_and_go_out_in_order():
    box, socket, _, _, wakes = make_outbox()
    box.put_many([])
    assert wakes == []
    box.put_many([(b"a", b"1"), (b"b", b"2")])
    box.put_many([(b"a", b"3")])
    assert len(wakes) == 2 and socket.sent == []
    box.send_routed()
    assert socket.sent == [(b"a", b"1"), (b"b", b"2"), (b"a", b"3")]
