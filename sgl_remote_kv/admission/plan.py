"""What a parked request could fetch, and what it will: the queue's collaborator for keys and counts.

- ``chains``: the prompt's full-chunk keys per path the request may use (one hashing per distinct codec);
- ``count`` (lookup worker thread): the *tokens* the store holds per path beyond the local full chunks —
  leading full chunks, then the tail sub-chunks of the first chunk region the store lacks (one or two
  store round trips per distinct codec and granule);
- ``plan`` (scheduler thread): the agreed token count turned into the fetch list, full chunks then
  sub-chunks, the same on every TP rank (the tail keys are recomputed from the agreed count: another
  rank's count may name another region than this rank's lookup did).
"""

from __future__ import annotations

from sgl_remote_kv.admission.parked import ParkedRequest
from sgl_remote_kv.admission.ports import AdmissionSettings, Collaborators
from sgl_remote_kv.store.base import StoreError
from sgl_remote_kv.types import PathName


class FetchPlanner:
    """See module docstring. ``budget``: rows the queue may hold (a larger fetch is trimmed)."""

    def __init__(self, c: Collaborators, settings: AdmissionSettings, budget: int) -> None:
        self.c, self.s, self.budget = c, settings, budget

    def granule(self, path) -> int:
        """Tail sub-chunk tokens on ``path`` (0: full chunks only, where the backend or the codec needs them)."""
        if not self.s.tail_granule or not getattr(path.backend, "tails", False) or not path.codec.sub_chunks:
            return 0
        return self.s.tail_granule

    def fetch_end(self, prompt_len: int) -> int:
        """The most prompt tokens any path could bring from the store (the last token is always computed)."""
        chunk = self.s.chunk_size
        usable_tokens = prompt_len - 1
        usable = usable_tokens // chunk
        g = max((self.granule(path) for path in self.c.paths.values()), default=0)
        return usable * chunk + ((usable_tokens - usable * chunk) // g * g if g else 0)

    def chains(self, ids, salt, paths) -> dict[PathName, list[bytes]]:
        """Keys of the prompt's full chunks ``[0, usable)`` per path of ``paths`` (the request may use
        these; ``count`` and the policy consider them only)."""
        usable = (len(ids) - 1) // self.s.chunk_size
        by_codec: dict[str, list[bytes]] = {}
        chain = {}
        for name, path in paths.items():
            if path.codec.name not in by_codec:
                by_codec[path.codec.name] = self.c.keys(ids, usable, salt, path.codec)
            chain[name] = by_codec[path.codec.name]
        return chain

    def count(self, ids, salt, local_chunks: int, chain: dict[PathName, list[bytes]]) -> dict[PathName, int]:
        """Remote tokens per path of ``chain`` (see module docstring). Raises ``StoreError`` if a store call failed
        and no path found anything: an error, not a miss."""
        try:
            seen: dict = {}  # (codec, granule) -> tokens
            out, errors = {}, []
            for name in chain:
                path = self.c.paths[name]
                memo = (path.codec.name, self.granule(path))
                if memo not in seen:
                    seen[memo] = self._found(
                        ids, salt, local_chunks, chain[name], path.codec, memo[1], errors
                    )
                out[name] = seen[memo]
            if errors and not any(out.values()):
                raise StoreError(f"remote KV lookup failed ({errors[0]})")
            return out
        finally:
            self.c.wakeup.set()

    def _found(self, ids, salt, local_chunks, chain, codec, granule: int, errors: list) -> int:
        chunk = self.s.chunk_size
        f = 0
        if len(chain) > local_chunks:
            r = self.c.lookup(chain[local_chunks:])
            f = r.found
            if r.error:
                errors.append(r.error)
        subs = self._tail_room(len(ids), local_chunks + f, granule)
        if subs <= 0:
            return f * chunk
        region = local_chunks + f
        keys = self.c.tail_keys(ids, region, chain[region - 1] if region else None, salt, codec, granule)
        r = self.c.lookup(keys[:subs])
        if r.error:
            errors.append(r.error)
        return f * chunk + r.found * granule

    def _tail_room(self, prompt_len: int, region: int, granule: int) -> int:
        """Tail sub-chunks the prompt has in chunk region ``region`` (fewer than a chunk's worth)."""
        if not granule:
            return 0
        chunk = self.s.chunk_size
        end = min((region + 1) * chunk, prompt_len - 1)
        return min(chunk // granule - 1, max(0, end - region * chunk) // granule)

    def plan(self, p: ParkedRequest, tokens: int) -> bool:
        """The fetch of the agreed ``tokens`` on ``p.path``: its full chunks, then the tail sub-chunks of
        the next chunk's region. A fetch larger than the queue's budget keeps its leading full chunks
        (the rest is recomputed). Sets ``p.fetch_keys``/``p.fetch_tokens``; False: nothing fits."""
        chunk, g = self.s.chunk_size, self.granule(self.c.paths[p.path])
        n, subs = tokens // chunk, (tokens % chunk) // g if g else 0
        if tokens > self.budget:
            n, subs = min(n, self.budget // chunk), 0
        if n + subs <= 0:
            return False
        region = p.local_chunks + n
        chain = p.chain[p.path]
        keys = chain[p.local_chunks : region]
        if subs:
            host, path = self.c.host, self.c.paths[p.path]
            ids, prev = host.prompt(p.req), chain[region - 1] if region else None
            keys = keys + self.c.tail_keys(ids, region, prev, host.salt(p.req), path.codec, g)[:subs]
        p.fetch_keys, p.fetch_tokens = keys, [chunk] * n + [g] * subs
        return True
