"""Redis key names, in one place so gateways and workers of one release agree on them."""

PREFIX = "slogate"
GROUP = "workers"
CANCEL_CHANNEL = f"{PREFIX}:cancel"


def queue(pool: str) -> str:
    return f"{PREFIX}:q:{pool}"


def replies(gateway_id: str) -> str:
    """Where a gateway's results arrive: every request it queues names this stream."""
    return f"{PREFIX}:r:{gateway_id}"


def alive(gateway_id: str) -> str:
    """Set while the gateway runs (it renews a short TTL): once it is gone, nobody reads the
    answers of its requests, and workers stop them."""
    return f"{PREFIX}:alive:{gateway_id}"


def cancel(request_id: str) -> str:
    return f"{PREFIX}:cancel:{request_id}"


def heartbeat(pool: str, worker_id: str) -> str:
    return f"{PREFIX}:hb:{pool}:{worker_id}"


def stream_slots(key_id: str) -> str:
    """The streams an API key has open, across gateways (a sorted set by when each ends)."""
    return f"{PREFIX}:streams:{key_id}"


WORKERS = f"{PREFIX}:workers"
"""The names of the heartbeat keys that may be live (a set): gateways read the fleet from it,
not by scanning the keyspace, whose cancel flags alone can number a million."""

PROMPT_RATIOS = f"{PREFIX}:prompt_ratios"
"""What gateways learned of prompt characters a token, per model and API key (a hash,
``policies.prompt_tokens``), so that a gateway that starts does not start from the prior."""
