"""``torchyard up`` waits for its worker's first heartbeat by listing the api's nodes: an error answer
on the way (a 503 while the database is busy, a JSON body of ``{"detail": ...}``) is waited through
and named, never taken for the node list (it once was: ``TypeError: string indices must be
integers`` ended one fresh start in four)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cli.local import listed_nodes
from cli.wait import wait_for

NODE = {"id": "node-1", "slots": 4, "devices": ["cpu"]}


class Answers:
    """What the stand-in api answers to GET /api/v1/nodes, in turn; the last one for good."""

    def __init__(self, *answers: tuple[int, object]) -> None:
        self.answers = list(answers)
        self.asked = 0
        self.tokens: list[str] = []

    def next(self) -> tuple[int, object]:
        self.asked += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


@pytest.fixture
def api() -> Iterator[tuple[str, Answers]]:
    answers = Answers((503, {"detail": "database is busy"}))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            assert self.path == "/api/v1/nodes"
            answers.tokens.append(self.headers["Authorization"])
            status, body = answers.next()
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", answers
    server.shutdown()
    server.server_close()


def test_error_answers_are_waited_through_until_a_node_is_listed(api: tuple[str, Answers]) -> None:
    url, answers = api
    answers.answers = [(503, {"detail": "database is busy"}), (401, {"detail": "token?"}), (200, []), (200, [NODE])]
    found = wait_for(lambda: listed_nodes(url, "ty_secret"), 30, "a node", interval=0.01)
    assert found == [NODE] and answers.asked == 4
    assert set(answers.tokens) == {"Bearer ty_secret"}


def test_an_api_that_only_errs_times_out_naming_its_answer(api: tuple[str, Answers]) -> None:
    url, answers = api
    with pytest.raises(TimeoutError, match=r"a node \(last error: GET /api/v1/nodes answered 503: .*database is busy"):
        wait_for(lambda: listed_nodes(url, "ty_secret"), 0.3, "a node", interval=0.01)
    assert answers.asked >= 1


def test_a_body_that_is_no_list_is_never_the_node_list(api: tuple[str, Answers]) -> None:
    url, answers = api
    answers.answers = [(200, {"detail": "not a list"})]
    with pytest.raises(RuntimeError, match="answered no list"):
        listed_nodes(url, "ty_secret")
