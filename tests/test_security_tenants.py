"""Tenant isolation at the key level: what the serving path derives from a request's ``cache_salt`` /
``extra_key`` (``keys.tenant_salt`` + ``KeySpace.keys_for``) never lets two tenants share a
chunk key, and a tenant's presence query never sees another tenant's chunks in a real store.
(The namespace function itself is covered by ``test_store_keys.py``; the end-to-end check with a real
server, including cached-token reports, is in ``test_faults_server.py``.)"""

from __future__ import annotations

import itertools

import pytest

from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.runtime import KeySpace
from sgl_remote_kv.store.client import ClientConfig, StoreClient
from sgl_remote_kv.store.keys import tenant_salt
from sgl_remote_kv.store.local import LocalStore
from sgl_remote_kv.types import KVLayout, ModelFingerprint

FP = ModelFingerprint("LlamaForCausalLM", KVLayout(30, 3, 64, "float32"), "weights", 0, 1)
PROMPT = list(range(1000, 1000 + 64 * 5))

# Pairs that a naive concatenation (salt + key, "salt|key", ...) would collide.
REQUEST_IDENTITIES = [
    (None, None),
    ("", None),
    (None, ""),
    ("", ""),
    ("a", None),
    (None, "a"),
    ("a", "b"),
    ("ab", None),
    ("a", "b|"),
    ("a|b", None),
    ('a","b', None),
    ("a", '","b'),
    ("null", None),
    ("[null, null]", None),
    ("é", None),
    ("\u00e9", "x"),
]


def test_tenant_salt_is_injective_over_tricky_identities():
    salts = [tenant_salt(c, e) for c, e in REQUEST_IDENTITIES]
    unique_ids = {(c, e) for c, e in REQUEST_IDENTITIES}
    assert len(set(salts)) == len(unique_ids)
    assert tenant_salt(None, None) is None  # the shared (unsalted) namespace


@pytest.fixture
def rt():
    return KeySpace(FP, get_codec("lossless"), 64)


@pytest.fixture
def client(tmp_path):
    c = StoreClient(LocalStore(tmp_path / "s"), ClientConfig(negative_ttl_s=0.0))
    yield c
    c.close()


def test_same_prompt_different_tenants_share_no_key(rt):
    key_sets = {}
    for c, e in REQUEST_IDENTITIES:
        keys = rt.keys_for(PROMPT, 5, tenant_salt(c, e))
        assert len(keys) == 5 and len(set(keys)) == 5
        key_sets[(c, e)] = set(keys)
    for a, b in itertools.combinations(key_sets, 2):
        assert not key_sets[a] & key_sets[b], (a, b)


def test_a_tenant_cannot_observe_another_tenants_prefix_in_the_store(rt, client):
    alice, bob = tenant_salt("alice", None), tenant_salt("bob", None)
    alice_keys = rt.keys_for(PROMPT, 5, alice)
    assert client.put_many([(k, b"kv-of-alice") for k in alice_keys]) == 5
    assert client.count_prefix(alice_keys) == 5
    for salt in (bob, None, tenant_salt(None, "alice"), tenant_salt("alice ", None)):
        keys = rt.keys_for(PROMPT, 5, salt)
        assert client.count_prefix(keys) == 0
        assert client.get_many(keys) == [None] * 5


def test_namespace_cache_cannot_be_grown_without_bound(rt):
    """Many distinct salts (one per request, hostile clients) must not grow memory without bound."""
    for i in range(5000):
        rt.namespace(tenant_salt(f"t{i}", None))
    assert len(rt._namespaces) <= 4096
