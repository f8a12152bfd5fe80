"""Multi-tenant: identical system prompts across tenants, kept apart only by per-tenant salts."""

from __future__ import annotations

import numpy as np

from cachelib.types import NO_EXTRA, ExtraKeys
from experiments.workloads.generators import (
    ConcatPrompt,
    Workload,
    common_knobs,
    json_config,
    make_rng,
    poisson_arrivals,
    random_tokens,
    require_int,
    sample_lengths,
)
from experiments.workloads.spec import RequestSpec


def tenant_salt(tenant: int) -> str:
    """The `cache_salt` of tenant `tenant`."""
    return f"tenant-{tenant}"


def multi_tenant(
    seed: int = 0,
    *,
    num_tenants: int = 4,
    system_len: int = 500,
    user_len: int = 100,
    num_requests: int = 200,
    output_len: int = 64,
    output_dist: str = "fixed",
    rate: float = 10.0,
    vocab_size: int = 32000,
    salted: bool = True,
    declare_system_prompt: bool = False,
) -> Workload:
    """Multi-tenant: every tenant sends the same system prompt under its own cache_salt.

    Each request is `system + user message` from a uniformly chosen tenant. The tokens are
    shared across tenants, so only the salt (it enters the first block's key) keeps one
    tenant from hitting another's KV: a correct cache reuses within a tenant only.

    Knobs:
    - num_tenants (4): tenants; tenant i's salt is "tenant-i".
    - system_len (500): tokens of the system prompt, identical for every tenant.
    - user_len (100): tokens of each request's own message.
    - num_requests (200): requests generated.
    - output_len (64), output_dist ("fixed"): answer length mean and its distribution
      (fixed | uniform | exponential).
    - rate (10.0): Poisson arrival rate, requests/s (inf: all at time 0).
    - vocab_size (32000): token ids are drawn from [0, vocab_size).
    - salted (True): False drops the salts (the control: tenants then share).
    - declare_system_prompt (False): declare the system prompt once per tenant (id tenant
      + 1, computed under that tenant's extra keys) so `paged` can share it.
    """
    config = json_config(**locals())  # first, so locals() holds exactly the knobs
    require_int("num_tenants", num_tenants)
    require_int("system_len", system_len)
    require_int("user_len", user_len)
    require_int("num_requests", num_requests, 0)
    common_knobs(vocab_size, rate, output_len, output_dist)
    rng = make_rng(seed, "multi_tenant")
    system = random_tokens(rng, system_len, vocab_size)
    extras = [ExtraKeys(cache_salt=tenant_salt(t)) if salted else NO_EXTRA for t in range(num_tenants)]
    who = rng.integers(0, num_tenants, num_requests)
    out_lens = sample_lengths(rng, num_requests, output_len, output_dist)
    arrivals = poisson_arrivals(rng, num_requests, rate)
    requests = []
    for i in range(num_requests):
        t = int(who[i])
        prompt = ConcatPrompt((system, random_tokens(rng, user_len, vocab_size)))
        requests.append(
            RequestSpec(
                f"tenant{t}-{i}",
                prompt,
                int(out_lens[i]),
                float(arrivals[i]),
                extras[t],
                prefix_id=t + 1 if declare_system_prompt else None,
            )
        )
    declared: dict[int, np.ndarray] = {}
    prefix_extra: dict[int, ExtraKeys] = {}
    if declare_system_prompt:
        declared = {t + 1: system for t in range(num_tenants)}
        prefix_extra = {t + 1: extras[t] for t in range(num_tenants)}
    return Workload("multi_tenant", requests, declared, config, prefix_extra)
