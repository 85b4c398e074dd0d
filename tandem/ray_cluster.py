"""Tandem on a Ray cluster: `tandem ray up | status | down`.

Each service runs as a detached Ray actor that supervises the service's own
process (`tandem serve ROLE`, the same as anywhere else) on the node Ray
places it on. The target and the draft take one bundle each of a placement
group, SPREAD by default, so that on a cluster of several nodes they land on
two (the pipeline's two devices); the orchestrator needs no GPU and goes
where there is room. Each actor writes the address it serves on into Redis,
under tandem:ray:NAME, which is how the orchestrator it starts finds the
model services, how an orchestrator started elsewhere finds them
(`tandem serve orchestrator --discover NAME`), and what `tandem ray status`
reads. A service process that dies is started again on the same port by its
actor, so that the callers' channels reconnect to it; `tandem ray down`
stops the processes (a graceful drain), kills the actors and frees the
placement group. With --target-replicas or --draft-replicas, a model service
runs as several actors, each with its own bundle: replica i > 0 of the target
is the slot "target-i" (its actor NAME-target-i, its Redis field target-i),
and the orchestrators get every replica's address (orchestrator.replicas).

Ray is imported only here, and only by these commands."""
from __future__ import annotations

import collections
import json
import logging
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import redis

log = logging.getLogger(__name__)

NAMESPACE = "tandem"  # the Ray namespace of Tandem's named actors and placement groups
ROLES = ("target", "draft", "orchestrator")
PLACEMENTS = {"spread": "SPREAD", "strict-spread": "STRICT_SPREAD", "pack": "PACK", "strict-pack": "STRICT_PACK"}
RESTART_BACKOFF_S = 2.0


def registry_key(name: str) -> str:
    """The Redis hash where a deployment's services write their addresses."""
    return f"tandem:ray:{name}"


def slots(role: str, replicas: int) -> list[str]:
    """A service's replicas' slots: the role for the first, then role-1, role-2, ..."""
    return [role] + [f"{role}-{i}" for i in range(1, replicas)]


def slot_parts(slot: str) -> tuple[str, int]:
    """(role, replica index) of a slot: "target" is ("target", 0), "target-2" ("target", 2)."""
    role, index = re.fullmatch(r"(.+?)(?:-(\d+))?", slot).groups()
    return role, int(index or 0)


def _slot_key(slot: str) -> tuple[int, int]:
    """Slots in ROLES' order, each role's replicas in theirs."""
    role, index = slot_parts(slot)
    return ROLES.index(role), index


def joined(fields: dict[str, str], role: str) -> str:
    """Every registered replica's address of a role, in slot order, comma-separated."""
    return ",".join(fields[slot] for slot in sorted((s for s in fields if slot_parts(s)[0] == role), key=_slot_key))


def discover(redis_url: str, name: str, wait_s: float = 0.0) -> dict[str, str]:
    """The deployment's registered addresses (field: target, draft,
    orchestrator, http; target and draft list every replica, comma-separated),
    waiting up to wait_s for the target and the draft."""
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=10)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            found = {k.decode(): v.decode() for k, v in client.hgetall(registry_key(name)).items()}
            if ("target" in found and "draft" in found) or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
    finally:
        client.close()
    missing = [role for role in ("target", "draft") if role not in found]
    if missing:
        raise ValueError(f"the Ray deployment {name!r} has no {' and no '.join(missing)} service registered in "
                         f"Redis ({registry_key(name)}): is it up (tandem ray up --name {name})?")
    return {**{k: v for k, v in found.items() if k in ROLES or k == "http"},
            "target": joined(found, "target"), "draft": joined(found, "draft")}


class ServiceSupervisor:
    """A Ray actor's body: one Tandem service's process on the actor's node,
    started again on the same port when it dies, until `stop`."""

    def __init__(self, role: str, argv: list[str], name: str, redis_url: str, slot: str = ""):
        self.role, self.argv, self.name, self.redis_url = role, list(argv), name, redis_url
        self.slot = slot or role  # its Redis field: role, or role-i for a replica i > 0
        self.process: subprocess.Popen | None = None
        self.port = 0  # chosen by the first start (--port 0), kept by the next ones
        self.http_port = 0
        self.restarts = 0
        self.stopping = False
        self.tail: collections.deque[str] = collections.deque(maxlen=40)  # the process's last stderr lines

    def _command(self) -> list[str]:
        argv = [*self.argv]
        if self.role == "orchestrator" and self.http_port and "--http-port" in argv:
            argv[argv.index("--http-port") + 1] = str(self.http_port)
        return [sys.executable, "-m", "tandem.cli", "serve", self.role, "--host", "0.0.0.0",
                "--port", str(self.port), *argv]

    def _spawn(self, timeout_s: float) -> None:
        """Starts the process and waits for its READY line. The process ends
        with the actor's (TANDEM_PARENT_PID: tandem.launch.die_with_parent)."""
        from tandem.launch import PARENT_ENV

        self.process = subprocess.Popen(self._command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())})
        threading.Thread(target=self._relay, args=(self.process.stderr,), daemon=True).start()
        lines: list[str] = []
        ready = threading.Event()
        threading.Thread(target=self._read_stdout, args=(self.process, lines, ready), daemon=True).start()
        ready.wait(timeout_s)
        ready = [line for line in lines if line.startswith("READY ")]
        if not ready:
            self.process.kill()
            self.process.wait()
            raise RuntimeError(f"the {self.role} service did not start in {timeout_s:.0f} s (exit code "
                               f"{self.process.returncode}); its last words:\n" + "\n".join(self.tail))
        self.port = int(ready[0].rsplit(":", 1)[1])
        http = [line for line in lines if line.startswith("HTTP ")]
        if http:
            self.http_port = int(http[0].rsplit(":", 1)[1])

    def _read_stdout(self, process: subprocess.Popen, lines: list[str], ready: threading.Event) -> None:
        """The process's stdout up to its READY line into `lines`, then on
        into the actor's log (a pipe left unread would fill and block it)."""
        for line in process.stdout:
            if not ready.is_set():
                lines.append(line.strip())
                if line.startswith("READY "):
                    ready.set()
            else:
                sys.stdout.write(line)
        ready.set()  # it ended before it was ready

    def _relay(self, stream) -> None:
        """The process's log into the actor's (Ray's worker log), and its tail kept for errors."""
        for line in stream:
            self.tail.append(line.rstrip())
            sys.stderr.write(line)

    def _register(self) -> dict[str, str]:
        import ray

        host = ray.util.get_node_ip_address()
        fields = {self.slot: f"{host}:{self.port}"}
        if self.http_port:
            fields["http"] = f"{host}:{self.http_port}"
        client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=5, socket_timeout=10)
        try:
            client.hset(registry_key(self.name), mapping=fields)
        finally:
            client.close()
        return fields

    def start(self, timeout_s: float = 600.0) -> dict[str, str]:
        """Starts the service; returns the addresses it serves on (also in Redis)."""
        self._spawn(timeout_s)
        threading.Thread(target=self._watch, args=(timeout_s,), daemon=True).start()
        return self._register()

    def _watch(self, timeout_s: float) -> None:
        """Starts the process again when it dies, on the same port."""
        while not self.stopping:
            code = self.process.wait()
            if self.stopping:
                return
            log.warning("the %s service exited with %s; starting it again on port %d", self.role, code, self.port)
            time.sleep(RESTART_BACKOFF_S)
            try:
                self._spawn(timeout_s)
                self.restarts += 1
            except RuntimeError:
                log.exception("the %s service did not start again", self.role)

    def status(self) -> dict:
        alive = self.process is not None and self.process.poll() is None
        return {"role": self.role, "alive": alive, "pid": self.process.pid if self.process else None,
                "port": self.port, "restarts": self.restarts}

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM (the service drains), then SIGKILL after grace_s."""
        self.stopping = True
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class NoCluster(RuntimeError):
    """The Ray cluster cannot be reached."""


def _connect(ray, address: str) -> None:
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError as err:
        raise NoCluster(f"cannot reach the Ray cluster at {address!r} ({err}); start one with 'ray start --head', "
                        "or give --address (or $RAY_ADDRESS)") from err


def _gpus_per_service(choice: str, cluster_gpus: float, services: int = 2) -> float:
    """auto: a GPU each where the cluster has one for every model service, else
    an equal share of one, as few sharing a GPU as the GPUs allow; 0 on CPUs."""
    if choice != "auto":
        return float(choice)
    if cluster_gpus < 1:
        return 0.0
    return 1.0 / math.ceil(services / math.floor(cluster_gpus))


def _actors(ray, name: str) -> dict[str, object]:
    """The deployment's actors by slot (target, target-1, draft, orchestrator, ...)."""
    pattern = re.compile(rf"{re.escape(name)}-((?:{'|'.join(ROLES)})(?:-\d+)?)")
    found = {}
    for actor_name in ray.util.list_named_actors():
        if (match := pattern.fullmatch(actor_name)) is not None:
            try:
                found[match.group(1)] = ray.get_actor(actor_name, namespace=NAMESPACE)
            except ValueError:
                continue  # gone meanwhile
    return found


def _with_default(argv: list[str], flag: str, value: str) -> list[str]:
    return argv if flag in argv else [*argv, flag, value]


def up(args) -> int:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    _connect(ray, args.address)
    if existing := _actors(ray, args.name):
        print(f"tandem ray up: a deployment {args.name!r} is up already (its {', '.join(sorted(existing))}); take "
              f"it down first (tandem ray down --name {args.name}) or choose another --name", file=sys.stderr)
        return 2
    services = [*slots("target", args.target_replicas), *slots("draft", args.draft_replicas)]
    gpus = _gpus_per_service(args.gpus_per_service, ray.cluster_resources().get("GPU", 0.0), len(services))
    bundle = {"CPU": args.cpus_per_service, **({"GPU": gpus} if gpus else {})}
    group = placement_group([bundle] * len(services), strategy=PLACEMENTS[args.placement],
                            name=f"{args.name}-services", lifetime="detached")
    print(f"waiting for room: {len(services)} bundles of {bundle}, {args.placement} ...", file=sys.stderr, flush=True)
    if not group.wait(args.timeout):
        remove_placement_group(group)
        print(f"tandem ray up: Ray found no room for {len(services)} bundles of {bundle} ({args.placement}) in "
              f"{args.timeout:.0f} s; the cluster has {ray.cluster_resources()}", file=sys.stderr)
        return 2
    supervisor = ray.remote(ServiceSupervisor)
    device = ["--device", "cuda"] if gpus else []
    argv = {
        "target": _with_default([*device, *shlex.split(args.target_args)], "--model", args.target_model),
        "draft": _with_default([*device, *shlex.split(args.draft_args)], "--model", args.draft_model),
    }
    actors = {}
    try:
        for index, slot in enumerate(services):
            role = slot_parts(slot)[0]
            actors[slot] = supervisor.options(
                name=f"{args.name}-{slot}", lifetime="detached", num_cpus=args.cpus_per_service, num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
            ).remote(role, argv[role], args.name, args.redis_url, slot)
        print(f"starting {', '.join(services)} ...", file=sys.stderr, flush=True)
        registered = {}
        for fields in ray.get([actors[slot].start.remote(args.timeout) for slot in services]):
            registered.update(fields)
        found = {"target": joined(registered, "target"), "draft": joined(registered, "draft")}
        orchestrator = [*shlex.split(args.orchestrator_args)]
        orchestrator = _with_default(orchestrator, "--tokenizer", args.draft_model)  # the pair shares one
        orchestrator = _with_default(orchestrator, "--http-port", "0")
        orchestrator += ["--target", found["target"], "--draft", found["draft"], "--redis-url", args.redis_url]
        actors["orchestrator"] = supervisor.options(name=f"{args.name}-orchestrator", lifetime="detached",
                                                    num_cpus=0).remote("orchestrator", orchestrator, args.name,
                                                                       args.redis_url)
        print("starting the orchestrator ...", file=sys.stderr, flush=True)
        found.update(ray.get(actors["orchestrator"].start.remote(args.timeout)))
    except (ray.exceptions.RayError, RuntimeError) as err:
        print(f"tandem ray up: {err}", file=sys.stderr)
        _take_down(ray, args.name, args.redis_url, actors)
        return 2
    print(json.dumps({"name": args.name, **found}))
    return 0


def _take_down(ray, name: str, redis_url: str, actors: dict | None = None) -> list[str]:
    """Stops the deployment's services (orchestrator first), kills their
    actors, frees the placement group and the registry; returns the slots found."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    actors = {**_actors(ray, name), **(actors or {})}
    found = sorted(actors, key=_slot_key, reverse=True)  # the orchestrator first
    for slot in found:
        try:
            ray.get(actors[slot].stop.remote(), timeout=60)
        except ray.exceptions.RayError as err:
            log.warning("the %s actor did not stop its service: %s", slot, err)
        ray.kill(actors[slot])
    try:
        remove_placement_group(get_placement_group(f"{name}-services"))
    except ValueError:
        pass
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        client.delete(registry_key(name))
    finally:
        client.close()
    return found


def down(args) -> int:
    import ray

    _connect(ray, args.address)
    found = _take_down(ray, args.name, args.redis_url)
    if not found:
        print(f"tandem ray down: no deployment {args.name!r} on this Ray cluster", file=sys.stderr)
        return 1
    print(f"stopped {', '.join(found)} of {args.name!r}", file=sys.stderr)
    return 0


def status(args) -> int:
    import ray

    _connect(ray, args.address)
    client = redis.Redis.from_url(args.redis_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        addresses = {k.decode(): v.decode() for k, v in client.hgetall(registry_key(args.name)).items()}
    finally:
        client.close()
    services = {}
    actors = _actors(ray, args.name)
    for slot in sorted(actors, key=_slot_key):
        services[slot] = {**ray.get(actors[slot].status.remote(), timeout=30), "address": addresses.get(slot)}
    print(json.dumps({"name": args.name, "services": services, "http": addresses.get("http")}))
    if not services:
        print(f"tandem ray status: no deployment {args.name!r} on this Ray cluster", file=sys.stderr)
        return 1
    whole = {slot_parts(slot)[0] for slot in services} == set(ROLES)
    return 0 if whole and all(s["alive"] for s in services.values()) else 3
