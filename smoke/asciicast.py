#!/usr/bin/env python3
"""Runs a command on a pseudo-terminal and records its output as an asciicast v2 file.

    asciicast.py FILE COMMAND [ARGS...]

The command's output is also passed through to this process's stdout, and its exit status is
returned (128+N for a signal). Format: https://docs.asciinema.org/manual/asciicast/v2/ -- a JSON
header line, then one `[seconds, "o", text]` line per chunk of output.
"""
import json
import os
import pty
import shutil
import sys
import time


def main() -> int:
    if len(sys.argv) < 3:
        print("usage: asciicast.py FILE COMMAND [ARGS...]", file=sys.stderr)
        return 2
    path, argv = sys.argv[1], sys.argv[2:]
    cols, rows = shutil.get_terminal_size((120, 40))
    start = time.time()
    with open(path, "w", encoding="utf-8") as cast:
        header = {
            "version": 2,
            "width": cols,
            "height": rows,
            "timestamp": int(start),
            "command": " ".join(argv),
            "env": {"SHELL": os.environ.get("SHELL", "/bin/sh"), "TERM": os.environ.get("TERM", "xterm")},
        }
        cast.write(json.dumps(header) + "\n")
        # An incremental decoder: a chunk may end inside a multi-byte UTF-8 sequence.
        decoder = __import__("codecs").getincrementaldecoder("utf-8")("replace")

        def read(fd: int) -> bytes:
            data = os.read(fd, 65536)
            text = decoder.decode(data)
            if text:
                cast.write(json.dumps([round(time.time() - start, 6), "o", text]) + "\n")
                cast.flush()
            return data

        status = pty.spawn(argv, read)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
