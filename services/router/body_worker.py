"""The body worker: a child process of the Router that decodes and checks large request
bodies, so the Router's event loop never holds the GIL for them.

`json.loads` holds the GIL for all of its work (12-20 ms for a 10 MB body here), and a thread
does not help: every other request of the Router waits that long. Here the bytes cross a pipe
(the loop writes them in pieces, between other work), this process decodes them, runs the
Router's first checks (`check_body`: the fields, then the prompt beyond the context by its
bytes alone) and answers with a few bytes for a refusal, or the body in `marshal` form (a
copy the Router loads 5-10 times faster than it parses the JSON).

Frames, on the child's stdin and stdout (lengths are 8-byte big-endian):

    request: kind (1 byte: `c` completion, `h` chat), length, the body's bytes
    reply:   tag (1 byte), length, payload; tag `B`: the body (`marshal`), tag `E`: the
             refusal as JSON `{"status", "message", "type", "param", "code"}`

    python -m services.router.body_worker --max-model-len N [--max-token-bytes N]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import marshal
import os
import struct
from collections.abc import Sequence
from typing import Any, Final

from services.common.inference_api.openai_api import (
    ApiError,
    Kind,
    check_length,
    decode_json,
    parse_request,
)
from services.router.tokenizer import least_tokens

HEADER: Final = struct.Struct("!cQ")
KIND_CODES: Final[dict[Kind, bytes]] = {"completion": b"c", "chat": b"h"}
_KINDS: Final[dict[bytes, Kind]] = {code: kind for kind, code in KIND_CODES.items()}
BODY: Final = b"B"
REFUSED: Final = b"E"
PIPE_BYTES: Final = 1 << 20  # Linux's default most an unprivileged process may ask for


def check_body(
    raw: bytes | bytearray, kind: Kind, max_token_bytes: int | None, max_model_len: int
) -> dict[str, Any]:
    """`raw` as a JSON object whose fields parse and whose prompt is not beyond the context
    by its bytes alone (`least_tokens`); raises `ApiError` 400 as the Router would."""
    body = decode_json(raw)
    req = parse_request(kind, body)
    least = least_tokens(req, max_token_bytes)
    if least >= max_model_len:
        check_length(least, req.max_tokens, max_model_len, at_least=True)
    return body


def refusal_json(err: ApiError) -> bytes:
    """`err`'s fields, for `refusal_from_json` on the Router's side."""
    fields = {"status": err.status, "message": err.message, "type": err.type}
    return json.dumps({**fields, "param": err.param, "code": err.code}).encode()


def refusal_from_json(payload: bytes) -> ApiError:
    fields = json.loads(payload)
    return ApiError(
        int(fields["status"]),
        str(fields["message"]),
        type_=str(fields["type"]),
        param=fields["param"],
        code=fields["code"],
    )


def _read_exactly(fd: int, n: int) -> bytearray | None:
    """`n` bytes from `fd`, or None at the end of input."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            return None
        got += k
    return buf


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def serve(fd_in: int, fd_out: int, max_token_bytes: int | None, max_model_len: int) -> None:
    """Answer request frames from `fd_in` on `fd_out` until `fd_in` ends."""
    while True:
        header = _read_exactly(fd_in, HEADER.size)
        if header is None:
            return
        code, size = HEADER.unpack(header)
        raw = _read_exactly(fd_in, size)
        if raw is None:
            return
        try:
            body = check_body(raw, _KINDS[code], max_token_bytes, max_model_len)
            tag, payload = BODY, marshal.dumps(body)
        except ApiError as err:
            tag, payload = REFUSED, refusal_json(err)
        del raw
        _write_all(fd_out, HEADER.pack(tag, len(payload)))
        _write_all(fd_out, payload)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m services.router.body_worker")
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-token-bytes", type=int, default=0, help="0: not known")
    a = p.parse_args(argv)
    fd_in, fd_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # whatever else prints goes to stderr, never into a frame
    for fd in (fd_in, fd_out):  # a megabyte a write, not the default 64 KiB: fewer wake-ups
        with contextlib.suppress(OSError, AttributeError):  # (not Linux, or not a pipe)
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    serve(fd_in, fd_out, a.max_token_bytes or None, a.max_model_len)


if __name__ == "__main__":
    main()
