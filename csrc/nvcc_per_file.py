"""Runs nvcc with the -gencode flags and include directories that setup.py chose for the source file it compiles.

torch's extension build compiles every CUDA source with the same flags; a kernel family's translation units need
only that family's archs (csrc/generate.py, PARTS), and the mma.sync ones take a header overlay
(csrc/mma_sync_include/README.md). setup.py writes {source path: {"gencode": [-gencode flags], "include": [dirs]}}
to a JSON file and points torch at this script through PYTORCH_NVCC (the variable torch reads for a compiler
wrapper such as ccache): `python nvcc_per_file.py MAP NVCC_COMMAND_JSON nvcc-args...`. A mapped source's -gencode
flags replace torch's, and its include directories go first, ahead of every -I torch passes; a source missing from
the map keeps the flags torch gave it.

With FLASH_ATTN2_BUILD_LOG set to a file, each compile appends one JSON line to it: the source, its wall time and
the peak resident memory of its largest compiler process (cicc, ptxas, ...), which is what a build's memory per
job is sized by.
"""

import json
import os
import resource
import subprocess
import sys
import time


def main() -> int:
    map_path, command_json, *args = sys.argv[1:]
    with open(map_path) as f:
        per_file = json.load(f)
    command = json.loads(command_json)
    # torch's command line holds "-c" twice ("-c -c file.cu"): the source follows the last one.
    source = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "-c" and not args[i + 1].startswith("-")), None)
    chosen = per_file.get(os.path.abspath(source)) if source is not None else None
    if chosen is not None:
        includes = [f"-I{path}" for path in chosen["include"]]
        args = includes + [a for a in args if not a.startswith("-gencode=")] + chosen["gencode"]
    log = os.environ.get("FLASH_ATTN2_BUILD_LOG")
    if not log:
        os.execvp(command[0], command + args)
    start = time.monotonic()
    returncode = subprocess.call(command + args)
    # ru_maxrss of the children: the largest of nvcc and every compiler process it waited for, in KiB.
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    record = {"source": source, "seconds": round(time.monotonic() - start, 1), "peak_gib": round(peak_kib / 2**20, 3)}
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")
    return returncode


if __name__ == "__main__":
    sys.exit(main())
