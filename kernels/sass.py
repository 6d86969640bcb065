"""The machine code (SASS) of a compiled kernel, for what only ptxas's schedule can answer: which loads it
placed ahead of a PDL wait.

`griddepcontrol.wait` is ACQBULK in SASS and `griddepcontrol.launch_dependents` is PREEXIT. ptxas takes
the data of a non-coherent load (`ld.global.nc`, SASS `LDG ... .CONSTANT`) for constant through the
kernel's life, so it may schedule such a load across the wait. That is right for weights, and wrong for
anything the step writes: such a load can then read it before the previous kernel has written it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_FUNCTION = re.compile(r"^\s*\.text\.(\S+):\s*$")
_LABEL = re.compile(r"^\s*\.L_\w+:\s*$")
_ENDS_BLOCK = re.compile(r"\b(BRA|BRX|JMP|JMX|EXIT|RET|CALL)\b")
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;?\s*$")


class NoDisassembler(RuntimeError):
    pass


def nvdisasm() -> Path:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel (the test extra), else from a CUDA toolkit."""
    for base in sys.path:
        for cu in ("cu13", "cu12"):
            p = Path(base or ".") / "nvidia" / cu / "bin" / "nvdisasm"
            if p.is_file():
                return p
    found = shutil.which("nvdisasm")
    if found:
        return Path(found)
    if Path("/usr/local/cuda/bin/nvdisasm").is_file():
        return Path("/usr/local/cuda/bin/nvdisasm")
    raise NoDisassembler("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the test extra)")


def disassemble(cubin: bytes) -> str:
    """nvdisasm's listing of a CUBIN, control flow kept (labels and branches)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(nvdisasm()), "-c", str(path)], capture_output=True, text=True, check=True)
    return out.stdout


@dataclass(frozen=True)
class EarlyLoad:
    function: str
    instruction: str


def functions(sass: str) -> dict[str, list[str]]:
    """Each function's lines, by name."""
    out: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
    return out


def loads_ahead_of_wait(sass: str) -> list[EarlyLoad]:
    """The non-coherent loads, other than the weight stream's (`ld.global.nc.L1::no_allocate`, SASS .NA),
    that ptxas put in the straight-line code that ends at a PDL wait: each would read before the wait."""
    found = []
    for name, lines in functions(sass).items():
        for i, line in enumerate(lines):
            if "ACQBULK" not in line:
                continue
            j = i - 1
            while j >= 0 and not _LABEL.match(lines[j]) and not _ENDS_BLOCK.search(lines[j]):
                m = _INSTRUCTION.search(lines[j])
                op = m.group(1) if m else ""
                if "LDG" in op and ".CONSTANT" in op and ".NA" not in op:
                    found.append(EarlyLoad(name, op))
                j -= 1
    return found


def opcodes(sass: str) -> list[str]:
    """Every instruction's opcode with its modifiers (e.g. `STG.E.64.STRONG.GPU`), predicates dropped, in
    listing order."""
    out = []
    for line in sass.splitlines():
        m = _INSTRUCTION.search(line)
        words = m.group(1).split() if m else []
        if words and words[0].startswith("@"):
            words = words[1:]
        if words:
            out.append(words[0])
    return out


def waits(sass: str) -> int:
    """PDL waits in the listing."""
    return sum("ACQBULK" in line for line in sass.splitlines())
