"""Asking the ranks on other nodes for their live stacks: the request and answer files.

A rank's live stacks are asked for by a signal (``stacks.LIVE_SIGNAL``), and a signal reaches
only processes on the sender's host. A multi-node run dir is one shared dir, so it carries the
question: ``commviz status`` writes a request (``RUN_DIR/stacks_request.json``: a token, who
asked, the ranks it signalled itself), each node's ``commviz launch`` polls it
(``commviz.launch.answer``), signals its own ranks and, once their dumps are on the disk,
answers (``RUN_DIR/stacks_answer_node{N}.json``: the token, its host, its ranks, the ranks it
signalled and those whose dump arrived). Declared once (``RequestFile``, ``AnswerFile``).

Both names exist before any request: each launch writes its answer file when it starts (token
None: it is there and listening) and the request file if there is none yet. A shared file system
(NFS) may keep believing for up to a minute that a name it looked up does not exist; a name
that exists is looked up again at each open.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Literal, Sequence

from typing_extensions import TypedDict

from commviz.errors import SourceError
from commviz.filetype import STRICT, FileType
from commviz.record.store import write_atomic

REQUEST_NAME = "stacks_request.json"
ANSWER_NAME = "stacks_answer_node{node}.json"
ANSWER_GLOB = "stacks_answer_node*.json"
POLL_S = 0.5                   # how often a launch looks for a new request


class RequestFile(TypedDict):
    """``RUN_DIR/stacks_request.json``: the latest request for every rank's stacks."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    schema: Literal["commviz.stacks_request"]
    version: Literal[1]
    token: str | None           # None: no request yet (written by a launch at its start)
    host: str                   # who asked
    pid: int
    time_ns: int
    signalled: list[int]        # the ranks the asker signalled itself: not to be asked again


class AnswerFile(TypedDict):
    """``RUN_DIR/stacks_answer_node{N}.json``: one launch's answer to the latest request."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    schema: Literal["commviz.stacks_answer"]
    version: Literal[1]
    token: str | None           # the request answered; None: none yet (the launch started)
    node: int                   # the launch's --node-rank
    host: str
    pid: int                    # the launch's
    ranks: list[int]            # the ranks this launch runs (as torch numbered them)
    signalled: list[int]        # those it asked for their stacks now
    written: list[int]          # of those, the ranks whose dump reached the run dir


REQUEST = FileType(RequestFile, "stacks request")
ANSWER = FileType(AnswerFile, "stacks answer")


def _request(token: str | None, signalled: Sequence[int]) -> RequestFile:
    return RequestFile(schema=REQUEST.schema, version=REQUEST.version, token=token,
                       host=socket.gethostname(), pid=os.getpid(), time_ns=time.time_ns(),
                       signalled=sorted(signalled))


def ask(run_dir: Path, signalled: Sequence[int]) -> str:
    """Write a new request; its token."""
    token = uuid.uuid4().hex
    write_atomic(Path(run_dir) / REQUEST_NAME, REQUEST.dump_json(_request(token, signalled)))
    return token


def read_request(run_dir: Path) -> RequestFile | None:
    """The latest request; None when there is none (a bad file is a ``SourceError``)."""
    path = Path(run_dir) / REQUEST_NAME
    return REQUEST.load(path) if path.exists() else None


def answer_path(run_dir: Path, node: int) -> Path:
    return Path(run_dir) / ANSWER_NAME.format(node=node)


def answer(run_dir: Path, node: int, token: str | None, ranks: Sequence[int],
           signalled: Sequence[int] = (), written: Sequence[int] = ()) -> None:
    """Write this launch's answer (``token`` None: it started and listens)."""
    doc = AnswerFile(schema=ANSWER.schema, version=ANSWER.version, token=token, node=node,
                     host=socket.gethostname(), pid=os.getpid(), ranks=sorted(ranks),
                     signalled=sorted(signalled), written=sorted(written))
    write_atomic(answer_path(run_dir, node), ANSWER.dump_json(doc, indent=1))


def listen(run_dir: Path, node: int) -> None:
    """A launch's start: its answer file (no request answered yet), and the request file
    unless there is one. That one is made by a hard link: whole or not at all, and never over
    another launch's or an asker's file."""
    answer(run_dir, node, None, ())
    path = Path(run_dir) / REQUEST_NAME
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(REQUEST.dump_json(_request(None, [])))
        os.link(tmp, path)
    except OSError:             # there is one already, or no hard links here: only NFS needs it
        pass
    finally:
        os.unlink(tmp)


def tidy(run_dir: Path, node: int) -> None:
    """A launch's end: its answer file and the request file go where nobody asked (a run that
    was never asked leaves neither)."""
    own, request = answer_path(run_dir, node), Path(run_dir) / REQUEST_NAME
    for path, kind in ((own, ANSWER), (request, REQUEST)):
        try:
            if kind.load(path)["token"] is None:
                path.unlink()
        except (SourceError, OSError):
            pass


def answers(run_dir: Path) -> tuple[list[AnswerFile], list[str]]:
    """Every launch's latest answer, by node; and one problem per answer file that cannot be
    read."""
    found, problems = [], []
    for path in sorted(Path(run_dir).glob(ANSWER_GLOB)):
        try:
            found.append(ANSWER.load(path))
        except SourceError as exc:
            problems.append(str(exc))
    return sorted(found, key=lambda a: a["node"]), problems
