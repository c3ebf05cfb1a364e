"""Calibration texts: several kinds of text, found in files every machine of the supported image has.

A calibration is only as general as its texts: fitted on license prose alone, the transform codec's
static rANS tables and its level->KL map did not transfer to JSON or to non-English prose. The default
fit set holds one or two texts of each ``TextKind``; each source names its file (Debian packages, or a
file inside a pinned Python package) and the SHA-256 it had when the committed results were measured,
so a fit on another machine says which text differs instead of silently producing another calibration.

``chat`` texts are built, not found: consecutive paragraphs of a source file become alternating user /
assistant turns rendered with the model's own chat template (what a multi-turn server caches).

Contract: pure functions of the files and the tokenizer; nothing here imports torch or SGLang.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.util
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class TextKind(enum.Enum):
    PROSE = "prose"
    CODE = "code"
    JSON = "json"
    MULTILINGUAL = "multilingual"
    CHAT = "chat"


def _package_file(package: str, rel: str) -> Path:
    """A file inside an installed package (found without importing it)."""
    spec = importlib.util.find_spec(package)
    roots = list(spec.submodule_search_locations or []) if spec else []
    return Path(roots[0]) / rel if roots else Path("/nonexistent") / package / rel


def _stdlib(rel: str) -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / rel


@dataclass(frozen=True)
class TextSource:
    """One text: where it is, what kind it is, and the digest it had where the results were measured."""

    name: str
    kind: TextKind
    locate: Callable[[], Path]
    sha256: str = ""  # of the file's bytes; "" = not pinned (e.g. the Python stdlib, version-dependent)

    @property
    def path(self) -> Path:
        return self.locate()

    def digest(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def check(self) -> str | None:
        """None when the file exists and matches its pinned digest, else why not (one line)."""
        p = self.path
        if not p.is_file():
            return f"{self.name}: {p} not found"
        if self.sha256 and self.digest() != self.sha256:
            return f"{self.name}: {p} differs from the pinned text (sha256 {self.digest()[:12]}, pinned {self.sha256[:12]})"
        return None

    def text(self, tokenizer=None) -> str:
        """The text as the model reads it (``tokenizer`` renders chat turns; required for CHAT)."""
        raw = self.path.read_bytes().decode("utf-8", errors="replace")
        if self.kind is not TextKind.CHAT:
            return raw
        if tokenizer is None:
            raise ValueError(f"{self.name}: a chat text needs the model's tokenizer")
        return chat_text(raw, tokenizer)


def chat_text(raw: str, tokenizer, turns: int = 40) -> str:
    """Paragraphs of ``raw`` as alternating user / assistant turns in the model's chat template."""
    paras = [" ".join(p.split()) for p in raw.split("\n\n")]
    paras = [p for p in paras if len(p) > 40][:turns]
    msgs = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": p if i % 2 else f"About this: {p}"}
        for i, p in enumerate(paras)
    ]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, tokenize=False)
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in msgs)


def _f(path: str) -> Callable[[], Path]:
    return lambda: Path(path)


def _pkg(package: str, rel: str) -> Callable[[], Path]:
    return lambda: _package_file(package, rel)


def _std(rel: str) -> Callable[[], Path]:
    return lambda: _stdlib(rel)


_LIC = "/usr/share/common-licenses/"
_TUTOR = "/usr/share/vim/vim90/tutor/"

# Every source the project measures with (CALIBRATION below is the default fit set; the rest is held out).
# Digests: the files where the committed results were measured; the Python stdlib's are not pinned (they
# change with the Python version).
SOURCES: dict[str, TextSource] = {
    s.name: s
    for s in (
        TextSource(
            "gpl3",
            TextKind.PROSE,
            _f(_LIC + "GPL-3"),
            "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986",
        ),
        TextSource(
            "dpkg_triggers",
            TextKind.PROSE,
            _f("/usr/share/doc/dpkg/spec/triggers.txt"),
            "ef31fe26ba143c85070cf52929d3d237d471afb5fac31c93dd886a2543a42d7b",
        ),
        TextSource(
            "apache2",
            TextKind.PROSE,
            _f(_LIC + "Apache-2.0"),
            "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30",
        ),
        TextSource(
            "mpl2",
            TextKind.PROSE,
            _f(_LIC + "MPL-2.0"),
            "fab3dd6bdab226f1c08630b1dd917e11fcb4ec5e1e020e2c16f83a0a13863e85",
        ),
        TextSource("python_license", TextKind.PROSE, _std("LICENSE.txt"), ""),
        TextSource(
            "sglang_radix_cache",
            TextKind.CODE,
            _pkg("sglang", "srt/mem_cache/radix_cache.py"),
            "eea7015fcf678167ac7296b08c8dc568ccbe42a4bb106da23b33a7c59debec01",
        ),
        TextSource("textwrap_py", TextKind.CODE, _std("textwrap.py"), ""),
        TextSource(
            "sglang_schedule_policy",
            TextKind.CODE,
            _pkg("sglang", "srt/managers/schedule_policy.py"),
            "51e4f0f5f1e7370de34a23643b426367137bba8d28a5c39e7ec81bfb852b2401",
        ),
        TextSource(
            "jsonschema_swagger",
            TextKind.JSON,
            _pkg("jsonschema", "benchmarks/issue232/issue.json"),
            "79a3ce663311bb9bbc4692abb00f6e93bb9c3d94b9b64286e03fe190e4d0dc79",
        ),
        TextSource(
            "torch_graph_breaks",
            TextKind.JSON,
            _pkg("torch", "_dynamo/graph_break_registry.json"),
            "c42ed142048852a6f04633340ea2b51c804ec7639c68a339cd93020e14d1f0f5",
        ),
        TextSource(
            "vim_tutor_fr",
            TextKind.MULTILINGUAL,
            _f(_TUTOR + "tutor.fr.utf-8"),
            "ce3e51d0d411d0bbed3a289cca1d1efb854e648dce26642c914bc5c4911be5c2",
        ),
        TextSource(
            "vim_tutor_de",
            TextKind.MULTILINGUAL,
            _f(_TUTOR + "tutor.de.utf-8"),
            "7938bb722e26f9c398907992542c1bc128b5d902e6f152822e19ec8b3eec7fd0",
        ),
        TextSource(
            "vim_tutor_es",
            TextKind.MULTILINGUAL,
            _f(_TUTOR + "tutor.es.utf-8"),
            "a57e5e1e4ee04e2eaa7e7cc4894c86a471f56b19b5f443c705ebb526d7cc28d6",
        ),
        TextSource(
            "chat_gpl2",
            TextKind.CHAT,
            _f(_LIC + "GPL-2"),
            "8177f97513213526df2cf6184d8ff986c675afb514d4e68a404010521b880643",
        ),
        TextSource(
            "chat_lgpl21",
            TextKind.CHAT,
            _f(_LIC + "LGPL-2.1"),
            "dc626520dcd53a22f727af3ee42c770e56c97a64fe3adb063799d8ab032fe551",
        ),
    )
}

# The default fit set: one text of every kind (the fit's time grows with each), so the codec's tables and level->KL map are not fitted to one kind.
CALIBRATION: tuple[str, ...] = (
    "gpl3",
    "sglang_radix_cache",
    "jsonschema_swagger",
    "vim_tutor_fr",
    "chat_gpl2",
)


def calibration_sources() -> list[TextSource]:
    return [SOURCES[n] for n in CALIBRATION]
