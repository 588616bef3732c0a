"""Redis key names, in one place so gateways and workers of one release agree on them."""

PREFIX = "slogate"
GROUP = "workers"
CANCEL_CHANNEL = f"{PREFIX}:cancel"


def queue(pool: str) -> str:
    return f"{PREFIX}:q:{pool}"


def result(request_id: str) -> str:
    return f"{PREFIX}:r:{request_id}"


def cancel(request_id: str) -> str:
    return f"{PREFIX}:cancel:{request_id}"


def heartbeat(pool: str, worker_id: str) -> str:
    return f"{PREFIX}:hb:{pool}:{worker_id}"


HEARTBEAT_PATTERN = f"{PREFIX}:hb:*"
