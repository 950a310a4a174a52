"""The one settings object of surge: frozen, read from ``SURGE_*`` environment variables.

Every field carries its unit in its name. ``Settings()`` validates combinations at start and
raises :class:`pipeline.exceptions.SettingsError` naming both values when they disagree.

Where a pure module has a config of its own (the scheduler, the degradation controller, the rate
limiter), the default is defined once in that module and the field here takes it from there. The
table of every variable is in README.md, "Configuration"; see also docs/architecture.md, "Settings".
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from pydantic_settings import SettingsError as EnvParseError

from pipeline import degrade, ratelimit, scheduler
from pipeline.exceptions import SettingsError
from pipeline.risk import records as risk_records
from pipeline.terms import PRIORITIES, TIERS, Priority

__all__ = ["PRIORITIES", "TIERS", "Settings"]  # PRIORITIES and TIERS: defined in pipeline.terms

_USERS = ratelimit.DEFAULT_USER_LIMITS
#: settings whose values never go into an error message
_SECRET_FIELD = re.compile(r"api_key|password", re.IGNORECASE)


def _default_deadline_ms(priority: Priority) -> int:
    """The scheduler's default deadline of ``priority``; 0 where it has none (offline)."""
    return scheduler.DEFAULT_DEADLINE_MS[priority] or 0


class Settings(BaseSettings):
    """All knobs of a surge process. Environment: ``SURGE_<FIELD>`` (case-insensitive).

    Build it with :meth:`load`, which turns validation failures into :class:`SettingsError`.
    """

    model_config = SettingsConfigDict(env_prefix="SURGE_", frozen=True, extra="ignore")

    # --- Kafka and Faust -------------------------------------------------------------------------
    broker: str = Field("kafka://127.0.0.1:9092", description="Kafka bootstrap servers, kafka://h:p[,h:p]")
    app_id: str = Field("surge", description="Faust app id: the consumer group and changelog prefix")
    topic_prefix: str = Field("surge.", description="prefix of every topic name")
    partitions: int = Field(8, ge=1, le=1024, description="partitions of each topic surge creates")
    replication_factor: int = Field(1, ge=1, le=16, description="replication factor of created topics")
    processing_guarantee: Literal["at_least_once"] = Field(
        "at_least_once",
        description="at_least_once only: repeats after a crash are made identical by the reply book "
        "(Faust's exactly_once was never made real here and is refused)",
    )
    session_timeout_s: float = Field(
        6.0,
        gt=1,
        le=300,
        description="consumer session timeout: how soon a dead worker's partitions move (6 s: the "
        "shortest a broker accepts at its default group.min.session.timeout.ms)",
    )
    commit_interval_ms: int = Field(
        500, ge=50, le=60_000, description="how often acked offsets are committed"
    )
    producer_request_timeout_ms: int = Field(
        30_000,
        ge=1_000,
        le=600_000,
        description="longest the worker's producer waits for the broker to answer one produce request "
        "before it closes the connection and sends the request's batches again on a new one (with "
        "Faust's 20 minutes, one request the broker never answered held the worker's replies, and "
        "every record after them, that long)",
    )
    producer_linger_ms: int = Field(
        2,
        ge=0,
        le=1_000,
        description="how long the worker's producer lets a batch of records wait for company before "
        "sending it, ms: more means fewer, larger produce requests and that much more latency on every "
        "hop (request to work topic, reply, reply-book record)",
    )
    fetch_max_wait_ms: int = Field(
        50,
        ge=1,
        le=10_000,
        description="longest one fetch of the worker's consumer waits for data, ms (Faust's own 1500 put "
        "requests in steps of about 1.6 s whenever readers paused and resumed their partitions)",
    )
    fetch_prefetch_backoff_ms: int = Field(
        5,
        ge=1,
        le=1_000,
        description="longest the worker's consumer holds back every fetch to a broker while records it "
        "fetched for one partition of that broker wait unread (aiokafka's own 100 put the first "
        "requests of a worker in bursts 100 ms apart, and real-time requests missed their deadline)",
    )
    data_dir: Path = Field(Path(".surge-data"), description="folder of the RocksDB table stores")
    delivery_order: Literal["priority", "round_robin"] = Field(
        "priority",
        description="order in which the records of one poll reach the worker's streams: priority hands "
        "the request topic's first, then the work topics' from real-time to offline, then the rest; "
        "round_robin is Faust's own order (over topics, then partitions)",
    )
    eager_delivery_enabled: bool = Field(
        True,
        description="the worker's consumer hands each fetched record to its stream inline, falling back "
        "to Faust's own four-task delivery only for a record that has to wait (off: Faust's delivery for "
        "every record; read once per process)",
    )
    eager_delivery_yield_every_records: int = Field(
        1,
        ge=1,
        le=1000,
        description="with eager_delivery_enabled, records handed to the streams between two turns of "
        "the event loop (Faust's own delivery takes at least one turn per record; read once per process)",
    )
    stream_buffer_max_records: int = Field(
        2048,
        ge=1,
        description="records Faust buffers per partition of a stream; it pauses the partition's fetch "
        "at 80 % (backpressure). A full buffer blocks delivery to every stream of the worker, so it "
        "must hold what arrives after the pause: at least 10 x max_poll_records",
    )
    max_poll_records: int = Field(
        200,
        ge=1,
        description="most records one poll of the worker's consumer hands over (all partitions); "
        "bounds what reaches a paused partition's buffer after its pause",
    )
    table_write_buffer_mb: int = Field(
        4,
        ge=1,
        le=1024,
        description="RocksDB write buffer of each table partition, MiB (two per partition at most): with "
        "the block cache, what bounds a worker's table memory however many keys clients create",
    )
    table_block_cache_mb: int = Field(
        8, ge=1, le=65536, description="RocksDB block cache of each table partition, MiB"
    )
    web_port: int = Field(6066, ge=1, le=65535, description="worker web port serving /metrics")
    role: Literal["intake", "inference", "all", "risk"] = Field(
        "all", description="which agents this worker runs (all: intake and inference; risk: the risk path)"
    )
    worker_id: str = Field("", description="name of this worker in logs; defaults to host:pid")
    static_membership: bool = Field(
        False,
        description="join the group with a stable group.instance.id: a worker back within "
        "session_timeout_s gets its partitions without a rebalance, a crashed one keeps them unserved "
        "until then (pair it with restarts faster than the session timeout), a stopped one (SIGTERM) "
        "leaves the group at once",
    )
    group_instance_id: str = Field(
        "", description="static member id; empty: worker_id, else derived from the host and data_dir"
    )
    reply_record_ttl_s: float = Field(
        3600.0, gt=0, description="how long a request's reply is kept to answer a redelivery identically"
    )
    standby_replicas: bool = Field(
        True, description="keep a standby copy of each table partition on another worker"
    )
    drain_timeout_s: float = Field(
        20.0, gt=0, description="on SIGTERM: longest wait for in-flight work to be answered and committed"
    )
    rebalance_grace_ms: int = Field(
        2000,
        ge=0,
        le=600_000,
        description="on a rebalance: how long admitted work may keep running before what has not "
        "reached the model is given back (read again by its partition's owner); the whole group waits "
        "for the slowest member's drain, so under overload this bounds the stall (batches already in "
        "the model still finish, up to drain_timeout_s)",
    )

    # --- embedded broker ---------------------------------------------------------------------------
    kafka_version: str = Field("4.1.1", description="Apache Kafka version resolved from Maven Central")
    kafka_cache_dir: Path = Field(
        Path.home() / ".cache" / "surge" / "kafka", description="where the broker's jars are cached"
    )
    kafka_heap_mb: int = Field(512, ge=128, le=65536, description="JVM heap of the embedded broker, MiB")

    # --- Kafka security (every client surge makes: Faust, gateway, admin, surge send/tail) -------------
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="how clients talk to Kafka: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL"
    )
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        "PLAIN", description="SASL mechanism (SASL_* protocols)"
    )
    kafka_sasl_username: str | None = Field(None, description="SASL user name (SASL_* protocols)")
    kafka_sasl_password: SecretStr | None = Field(None, description="SASL password (SASL_* protocols)")
    kafka_ssl_cafile: Path | None = Field(
        None, description="PEM file of the CAs that signed the brokers' certificates; default: system CAs"
    )
    kafka_ssl_certfile: Path | None = Field(
        None, description="PEM client certificate for mutual TLS (SSL, SASL_SSL)"
    )
    kafka_ssl_keyfile: Path | None = Field(None, description="PEM private key of kafka_ssl_certfile")
    kafka_ssl_key_password: SecretStr | None = Field(
        None, description="password of kafka_ssl_keyfile, if any"
    )
    kafka_ssl_check_hostname: bool = Field(
        True, description="check that a broker's certificate names the host connected to"
    )

    # --- records -------------------------------------------------------------------------------------
    max_record_bytes: int = Field(1 << 20, ge=1024, description="largest accepted request record, bytes")
    max_content_bytes: int = Field(32 << 10, ge=64, description="largest prompt or message content, bytes")
    reply_topic_pattern: str = Field(
        "",
        description="regular expression a request's reply_to must match in full; empty: the replies "
        "topic and <prefix>replies.<suffix>. Internal, work, changelog and surge's own topics are "
        "refused whatever it says",
    )
    model_aliases: str = Field(
        "", description="comma list of names a request's model field may use besides the served model's"
    )

    # --- models -------------------------------------------------------------------------------------
    model: Literal["faq", "hf", "remote", "echo"] = Field("faq", description="answer model backend")
    model_path: str | None = Field(None, description="Hugging Face causal LM folder (model=hf)")
    model_dtype: str = Field("auto", description="dtype of the HF model: auto, float32, bfloat16, float16")
    model_num_threads: int = Field(
        0, ge=0, description="torch CPU threads for the model and embedder; 0 = every core but one"
    )
    onednn_primitive_cache_entries: int = Field(
        8,
        ge=1,
        le=65536,
        description="kernels oneDNN keeps compiled in a worker, one per operation and input shape "
        "(oneDNN's default is 1,024): each embedding batch of a new size or length adds some, so with "
        "the default the embedder's memory grows by 45-56 MiB over its first minutes, with 8 by 15-19 MiB, "
        'at no measured cost in speed (docs/architecture.md, "Threads and the GIL")',
    )
    gil_switch_interval_ms: float = Field(
        1.0,
        gt=0,
        le=100,
        description="how long a Python thread may keep the GIL while another waits for it, milliseconds "
        "(CPython's default is 5): shorter lets the embedding and model threads take it back sooner "
        "after each native call while the event loop runs Python "
        '(docs/architecture.md, "Threads and the GIL")',
    )
    gc_young_threshold_objects: int = Field(
        50_000,
        ge=700,
        description="net allocations between young garbage collections (CPython's first threshold; its "
        "default is 700): at 700 a busy worker collects every few hundred microseconds, so objects that "
        "live a few milliseconds (sends waiting for their acks, records in a batch) are promoted to the "
        "oldest generation and set off a full collection, which stops the event loop, about once a "
        'second; at 50,000 they die young (docs/architecture.md, "Garbage collection")',
    )
    event_loop: Literal["asyncio", "uvloop"] = Field(
        "uvloop",
        description="the worker's event loop: uvloop's (libuv, in C: each record's futures, callbacks and "
        'socket writes cost less Python) or asyncio\'s own (docs/architecture.md, "Threads and the GIL")',
    )
    model_device_map: str | None = Field(None, description="HF device_map, e.g. auto")
    remote_base_url: str | None = Field(None, description="OpenAI-compatible endpoint (model=remote)")
    remote_model: str = Field("default", description="model name sent to the remote endpoint")
    remote_api_key: str | None = Field(None, description="API key of the remote endpoint")
    remote_timeout_s: float = Field(30.0, gt=0, description="timeout of one remote call, seconds")
    echo_delay_ms: float = Field(0.0, ge=0, description="echo model: time per batch, milliseconds")
    echo_per_item_ms: float = Field(0.0, ge=0, description="echo model: extra time per item, milliseconds")
    echo_poison: str | None = Field(
        None, description="echo model: a batch holding this text fails (failure-isolation drills)"
    )
    embedder_path: str | None = Field(None, description="sentence-transformers folder; default MiniLM-L6")
    faq_confidence_floor: float = Field(0.40, ge=0, le=1, description="FAQ answers below this say 'not sure'")
    faq_template_confidence_floor: float = Field(
        0.25,
        ge=0,
        lt=1,
        description="the same for the level-3 template's n-gram layer, whose probabilities are flatter",
    )
    faq_data_dir: str | None = Field(
        None,
        description="folder of retrained FAQ weights (surge faq train --out-dir); default: the shipped ones",
    )

    # --- scheduling ------------------------------------------------------------------------------------
    deadline_realtime_ms: int = Field(
        _default_deadline_ms(Priority.REALTIME), gt=0, description="real-time deadline from created_at, ms"
    )
    deadline_interactive_ms: int = Field(
        _default_deadline_ms(Priority.INTERACTIVE), gt=0, description="interactive deadline, ms"
    )
    deadline_batch_ms: int = Field(
        _default_deadline_ms(Priority.BATCH), gt=0, description="batch deadline, ms"
    )
    deadline_offline_ms: int = Field(
        _default_deadline_ms(Priority.OFFLINE), ge=0, description="offline deadline, ms; 0 = none"
    )
    deadlines_enabled: bool = Field(
        True,
        description="false: no request expires, whatever its class or deadline_ms (replays of old "
        "traffic, docs/architecture.md 'Replay')",
    )
    deadline_policy_batch: Literal["reject", "delay"] = Field(
        "reject",
        description="what happens to an expired batch item: 'reject' (a deadline_exceeded reply) or 'delay' (moved to the offline class)",
    )
    queue_limit_per_class: int = Field(
        scheduler.DEFAULT_QUEUE_LIMIT, ge=1, description="in-memory queue bound of each class"
    )
    max_batch_size: int = Field(
        scheduler.DEFAULT_MAX_BATCH_SIZE, ge=1, le=4096, description="largest micro-batch"
    )
    base_batch_size: int = Field(
        scheduler.DEFAULT_BASE_BATCH_SIZE, ge=1, description="batch size scale: ceil(base*ln(depth+1))"
    )
    max_wait_ms: float = Field(
        scheduler.DEFAULT_MAX_WAIT_MS, ge=0, description="longest a batch window stays open, ms"
    )
    max_wait_realtime_ms: float = Field(
        0.0,
        ge=0,
        description="longest a batch window that would take a real-time item stays open, counted from "
        "that item's arrival in the queue, ms (0: it runs as soon as the model is free; at 10, the "
        "general window, a lone real-time question waited 10 ms of its 200 for company)",
    )
    embed_max_batch_size: int = Field(
        64, ge=1, le=1024, description="most questions embedded in one call (calls grow with the backlog)"
    )
    embed_max_wait_ms: float = Field(
        30.0,
        ge=0,
        le=2000,
        description="longest an idle embedding stage waits after an arrival for more to embed in the "
        "same call, ms; only while arrivals come at least this often, never for a real-time one "
        "(0: each arrival is embedded at once)",
    )
    embed_chunk_size: int = Field(
        0,
        ge=0,
        le=1024,
        description="questions per forward pass of the embedder (a call's questions are sorted by length "
        "and cut into chunks of this size); 0: 8 on CPU, where small chunks pad least, 64 on an accelerator",
    )
    queue_target_ms: float = Field(
        1000.0,
        gt=0,
        description="admitted work is kept to about this much embedding and model time (measured); "
        "the rest waits in Kafka, so a rebalance or a stop drains quickly",
    )
    embed_budget_ms: float = Field(
        100.0,
        gt=0,
        description="an embedding call is sized to take about this long (measured per item), so a "
        "real-time or interactive arrival never waits long behind one; at most embed_max_batch_size",
    )
    embed_yield_to_realtime: bool = Field(
        True,
        description="an embedding batch without real-time items is embedded one forward pass per call, "
        "and real-time arrivals are embedded between the calls (off: one call per batch, so a real-time "
        "request admitted meanwhile waits for all of it, up to embed_budget_ms)",
    )
    intake_triage_max_records: int = Field(
        256,
        ge=1,
        le=4096,
        description="requests the intake takes off the request topic ahead of handling them, so that it "
        "handles the highest class first (real-time before interactive, batch, offline; in order within "
        "a class); 1 handles each record as it is read",
    )
    intake_triage_max_mb: int = Field(
        8,
        ge=1,
        le=1024,
        description="most MiB of request records the intake's triage queue holds at once (one record is "
        "always let in, however large)",
    )
    intake_first_enabled: bool = Field(
        True,
        description="in a worker that runs the intake too, batch and offline work is not read while "
        "requests wait behind the intake on the request topic (they share one event loop, and a cheap "
        "low-class backlog drained after a surge starved it)",
    )
    intake_first_lag_records: int = Field(
        32,
        ge=0,
        description="with intake_first_enabled, batch and offline reading stops once more than this many "
        "requests wait behind the intake in one request partition, and resumes once none waits",
    )
    intake_first_stall_ms: int = Field(
        2_000,
        ge=1,
        description="with intake_first_enabled, the hold gives way while the intake has taken no request "
        "for this long although requests wait: the low classes are held, so something else holds the "
        "intake up, and a hold must never stop the worker (logged as a warning)",
    )
    changelog_buffer_limit_records: int = Field(
        50,
        ge=0,
        description="batch and offline work is not read while more than this many writes wait to be "
        "handed to the producer: table writes in Faust's producer buffer (past 100 Faust stops "
        "delivering records to every stream, the intake's too), reply-book records in the book's "
        "outbox, and replies waiting in order for their records (a real-time reply waits behind them "
        "all); a fast drain of cheap low-class replies held real-time requests for seconds; 0: off",
    )
    embed_queue_limit: int = Field(
        128, ge=1, description="admitted items waiting to be embedded before readers stop reading"
    )
    queue_policy: Literal["edf", "fifo"] = Field(
        "edf", description="edf: priority + deadlines; fifo: baseline"
    )

    # --- dedup and caches ------------------------------------------------------------------------------
    dedup_enabled: bool = Field(True, description="merge semantically identical waiting/in-flight requests")
    cache_enabled: bool = Field(True, description="serve repeats from the exact and semantic caches")
    semantic_threshold: float = Field(
        0.92,
        gt=0,
        le=1,
        description="cosine similarity needed to merge under merge_decision=threshold, or for English with a custom embedder",
    )
    merge_decision: Literal["learned", "threshold"] = Field(
        "learned",
        description="learned: the shipped pair classifier (English with MiniLM, Chinese by characters); "
        "threshold: semantic_threshold and the guard alone",
    )
    merge_data_dir: str | None = Field(
        None,
        description="folder of retrained merge weights (surge dedup train --out-dir, which is required); "
        "default: the shipped ones",
    )
    semantic_cache_enabled: bool = Field(
        True,
        description="serve answers of similar questions from the cache; false: exact repeats only (a replay's "
        "default: an exact hit is the answer the model gives that text)",
    )
    cache_ttl_s: float = Field(3600.0, gt=0, description="life of a cached answer, seconds")
    cache_max_entries: int = Field(100_000, ge=1, description="cache size bound; LRU eviction beyond it")

    # --- rate limits -------------------------------------------------------------------------------------
    rate_limit_enabled: bool = Field(True, description="apply the token buckets")
    rate_limit_flush_ms: int = Field(
        500,
        ge=0,
        le=60_000,
        description="how long a bucket's newest state may stay in memory before it is written to the "
        "rate-limit table and its changelog, per partition, ms: one write per bucket for every request "
        "that changed it in that time; a crash forgets at most that much of a partition's requests "
        "(0: written after each request)",
    )
    user_rate_per_s_free: float = Field(
        _USERS["free"].rate_per_s, gt=0, description="free tier, requests/s per user"
    )
    user_burst_free: float = Field(_USERS["free"].burst, ge=1, description="free tier bucket size")
    user_rate_per_s_standard: float = Field(
        _USERS["standard"].rate_per_s, gt=0, description="standard tier, requests/s per user"
    )
    user_burst_standard: float = Field(
        _USERS["standard"].burst, ge=1, description="standard tier bucket size"
    )
    user_rate_per_s_premium: float = Field(
        _USERS["premium"].rate_per_s, gt=0, description="premium tier, requests/s per user"
    )
    user_burst_premium: float = Field(_USERS["premium"].burst, ge=1, description="premium tier bucket size")
    tenant_rate_per_s: float = Field(
        ratelimit.DEFAULT_TENANT_LIMITS.rate_per_s, gt=0, description="requests/s per tenant"
    )
    tenant_burst: float = Field(ratelimit.DEFAULT_TENANT_LIMITS.burst, ge=1, description="tenant bucket size")

    # --- degradation -------------------------------------------------------------------------------------
    degrade_enabled: bool = Field(True, description="run the overload degradation controller")
    degrade_up_queue_depth: tuple[float, float, float] = Field(
        degrade.DEFAULT_UP_QUEUE_DEPTH,
        description="queue depth per worker (items of classes with a deadline) at which levels 1, 2, 3 start (JSON list)",
    )
    degrade_down_queue_depth: tuple[float, float, float] = Field(
        degrade.DEFAULT_DOWN_QUEUE_DEPTH,
        description="queue depth per worker (items of classes with a deadline) under which levels 1, 2, 3 may step down",
    )
    degrade_up_miss_rate: tuple[float, float, float] = Field(
        degrade.DEFAULT_UP_MISS_RATE,
        description="deadline-miss rate (0-1, last 10 s) at which levels 1, 2, 3 start",
    )
    degrade_down_miss_rate: tuple[float, float, float] = Field(
        degrade.DEFAULT_DOWN_MISS_RATE,
        description="deadline-miss rate under which levels 1, 2, 3 may step down",
    )
    degrade_cooldown_ms: float = Field(
        degrade.DEFAULT_COOLDOWN_MS, ge=0, description="low pressure needed before stepping down"
    )
    degrade_max_tokens_cap: int = Field(
        degrade.DEFAULT_MAX_TOKENS_CAP, ge=1, description="max_tokens cap from level 2"
    )
    degrade_tick_ms: float = Field(
        250.0, gt=0, description="how often the controller reads the pressure, ms (also with no traffic)"
    )
    unreachable_window_ms: int = Field(
        2_000,
        ge=0,
        description="from degradation level 2, an item below real-time whose time left is shorter than "
        "its class's median wait for the model over this window (plus its embedding call) is refused "
        "deadline_exceeded before its embedding; 0 = never",
    )
    degrade_template: str = Field(
        "",
        max_length=4096,
        description="level-3 answer: 'faq' (the FAQ answerer), a fixed text, or empty: "
        "faq for model=faq, else a plain 'busy, try again' text",
    )

    # --- gateway -------------------------------------------------------------------------------------------
    gateway_port: int = Field(8000, ge=0, le=65535, description="HTTP port of the OpenAI-compatible gateway")
    api_keys: str = Field(
        "",
        description="gateway keys: comma list key:tenant[:tier[:max_priority]] or JSON; "
        "empty: no key needed, everyone is tenant default (development only)",
    )
    kafka_request_auth: Literal["auto", "signed", "open"] = Field(
        "auto",
        description="records written straight to the request topic: signed: each must carry an API "
        "key's id and an HMAC of its value (headers surge-key-id, surge-signature), its key's tenant, tier and "
        "highest priority apply as in the gateway, and its reply is signed back with the key (header "
        "surge-reply-signature), which the gateway and clients require; open: the record's tenant, "
        "tier and priority are taken as written and replies are unsigned (the topic's ACLs are the "
        "only boundary; development); auto: signed when api_keys is set, else open; set it alike on "
        "workers and gateways",
    )
    signed_request_max_age_s: float = Field(
        300.0,
        ge=0,
        description="where records are signed: the longest a signed request's created_at may lie from "
        "the time the broker appended its record (the request topic's LogAppendTime) before it is "
        "refused as invalid_request, so that a captured signed record written again later is not "
        "served again; signed requests must then carry created_at; at most reply_record_ttl_s; "
        "0 = no limit",
    )
    gateway_max_in_flight: int = Field(
        0, ge=0, description="requests a gateway waits on at once before answering 503; 0 = no bound"
    )
    gateway_timeout_ms: int = Field(30_000, gt=0, description="longest the gateway waits for a reply, ms")

    # --- risk (docs/architecture.md, "Risk") -------------------------------------------------------------
    risk_grace_ms: int = Field(
        5_000,
        ge=0,
        le=86_400_000,
        description="an event more than this behind its account's latest is late, ms",
    )
    risk_max_ahead_ms: int = Field(
        risk_records.MAX_AHEAD_MS,
        ge=0,
        le=86_400_000,
        description="an event dated more than this after the worker's clock is refused (an error "
        "decision and a dead letter): it would make its account's on-time events late; keep it at most "
        "risk_grace_ms, ms",
    )
    risk_horizon_ms: int = Field(
        60_000,
        ge=0,
        le=86_400_000,
        description="window tiles are kept this long beyond the window behind an entity's latest event, ms",
    )
    risk_small_amount: float = Field(
        5.0, gt=0, description="amounts at or below this count as small (card testing), currency units"
    )
    risk_dedup_ids: int = Field(
        16, ge=1, le=4096, description="event ids each account remembers so an event sent again counts once"
    )
    risk_seen_max: int = Field(
        64, ge=1, le=4096, description="devices and countries an account remembers for first-seen features"
    )
    risk_distinct_max: int = Field(
        64,
        ge=1,
        le=4096,
        description=(
            "distinct values a risk window tile keeps per field: a distinct-count feature (an ip's accounts, "
            "a device's cards) is the count up to this, so a shared IP cannot grow its state without bound"
        ),
    )
    risk_state_ttl_s: int = Field(
        2_592_000,
        ge=0,
        description=(
            "an entity state not changed for this long (worker clock, 30 days by default) expires: the "
            "entity's next event starts from an empty state, and a sweep deletes it from the table and "
            "its changelog (docs/architecture.md, 'Risk: state expiry'); 0 = states never expire"
        ),
    )
    risk_batch_max_records: int = Field(
        500,
        ge=1,
        le=10_000,
        description="most records a risk stage takes in one batch",
    )
    risk_batch_wait_ms: float = Field(
        10.0,
        ge=0,
        le=1000,
        description="once a risk stage takes up its next batch (a record has arrived), it waits this "
        "long for more; a batch costs a good deal besides its events, so at 1,000 events/s 10 ms gave a "
        "lower p99 than 5, 1, 15 and 20, and than a window counted from the first record's arrival "
        '(docs/architecture.md, "Risk: the chain"), ms',
    )
    risk_batches_in_flight: int = Field(
        2,
        ge=1,
        le=64,
        description="batches of one risk stage whose outputs may wait for the broker at once; the next "
        "batch takes what arrived meanwhile, so fewer in flight means bigger batches (8 kept a worker "
        'behind at 1,000 events/s, 2 keeps up: docs/architecture.md, "Risk: the chain")',
    )
    risk_feature_cache_entries: int = Field(
        200_000, ge=0, description="entity states kept decoded in memory per risk stage; 0 = no cache"
    )
    risk_model_enabled: bool = Field(True, description="score risk events with the model (else rules only)")
    risk_model_path: str | None = Field(
        None, description="folder written by `surge risk train`; default: the packaged model"
    )
    risk_review_score: float | None = Field(
        None, gt=0, lt=1, description="model score from which an event is reviewed; default: the model's own"
    )
    risk_decline_score: float | None = Field(
        None, gt=0, le=1, description="model score from which an event is declined; default: the model's own"
    )
    risk_publish_default_rules: bool = Field(
        True, description="a risk worker that finds surge.risk.rules empty publishes the default rules"
    )
    risk_escalation_enabled: bool = Field(
        False,
        description="put borderline risk decisions (review, or approve with a model score of at least "
        "risk_escalation_min_score) to the request path's model as real-time requests, and publish the "
        'decision once it answers (docs/architecture.md, "Risk: escalation"); needs risk_escalation_key',
    )
    risk_escalation_key: SecretStr | None = Field(
        None,
        description="secret that escalation request ids are derived from (the same on every risk worker): "
        "a client without it cannot predict an id and plant an answer in the reply book; a risk worker "
        "with a key reads the escalated cases, so keep it after turning escalation off until they are "
        "decided; request workers that want signed records need it too, to accept escalation requests "
        "(signed with a secret derived from it)",
    )
    risk_escalation_min_score: float = Field(
        0.3, ge=0, le=1, description="an approve with a model score at least this is escalated too"
    )
    risk_escalation_budget_ms: int = Field(
        150,
        ge=1,
        le=600_000,
        description="an escalation request's deadline, counted from when its event was produced; a case "
        "read after it (behind a backlog) is decided locally without asking, ms",
    )
    risk_escalation_wait_max_ms: int = Field(
        200,
        ge=1,
        le=600_000,
        description="an escalated event without a reply this long after it was produced is decided "
        "locally (the SLA); at least risk_escalation_budget_ms, ms",
    )
    risk_escalation_may_lower: bool = Field(
        False,
        description="let the model's answer make a decision milder (review to approve); off, it may only "
        "confirm or raise one, since event fields a client controls reach its prompt",
    )
    risk_escalation_tenant: str = Field(
        "risk",
        min_length=1,
        max_length=128,
        description="tenant of escalation requests (rate limits, scopes)",
    )
    risk_escalation_model: str | None = Field(
        None, description="the model field of escalation requests; default: the served model"
    )
    risk_escalation_reply_topic: str = Field(
        "",
        description="where escalation replies land; default: <prefix>replies.risk (it must be a reply "
        "topic the request path allows, SURGE_REPLY_TOPIC_PATTERN)",
    )
    risk_escalation_max_pending: int = Field(
        1_000,
        ge=1,
        le=100_000,
        description="escalations waiting for a reply at once; the rest wait in Kafka",
    )

    # --- replay and shadow (docs/architecture.md, "Replay") ------------------------------------------
    replay_rate_per_s: float = Field(
        500.0, ge=0, description="records/s a replay or shadow copies at most (throttle); 0 = no limit"
    )
    replay_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="niceness of a replay's or shadow's worker: the OS serves live workers first",
    )
    replay_idle_timeout_s: float = Field(
        60.0, gt=0, description="a replay stops waiting after this long without a new reply, seconds"
    )
    shadow_report_interval_s: float = Field(
        5.0, gt=0, description="how often a shadow rewrites its rolling comparison, seconds"
    )

    @model_validator(mode="after")
    def _check_combinations(self) -> Settings:
        if self.base_batch_size > self.max_batch_size:
            raise ValueError(
                f"base_batch_size={self.base_batch_size} must not exceed max_batch_size={self.max_batch_size}"
            )
        if not (self.deadline_realtime_ms <= self.deadline_interactive_ms <= self.deadline_batch_ms):
            raise ValueError(
                f"deadlines must not shrink with priority: deadline_realtime_ms={self.deadline_realtime_ms}, "
                f"deadline_interactive_ms={self.deadline_interactive_ms}, "
                f"deadline_batch_ms={self.deadline_batch_ms}"
            )
        if self.stream_buffer_max_records < 10 * self.max_poll_records:
            # Faust delivers a poll's records in order and waits on a full stream buffer: one
            # blocked lower-class reader would then hold real-time records behind it
            raise ValueError(
                f"stream_buffer_max_records={self.stream_buffer_max_records} must be at least "
                f"10 x max_poll_records={self.max_poll_records}"
            )
        if self.deadline_offline_ms and self.deadline_offline_ms < self.deadline_batch_ms:
            raise ValueError(
                f"deadline_offline_ms={self.deadline_offline_ms} must be 0 (none) or at least "
                f"deadline_batch_ms={self.deadline_batch_ms}"
            )
        if any(not 0 <= r <= 1 for r in (*self.degrade_up_miss_rate, *self.degrade_down_miss_rate)):
            raise ValueError(
                f"degrade_up_miss_rate={list(self.degrade_up_miss_rate)} and degrade_down_miss_rate="
                f"{list(self.degrade_down_miss_rate)} are shares of requests: each must be in [0, 1]"
            )
        self._check_degrade_thresholds()
        if self.max_content_bytes > self.max_record_bytes:
            raise ValueError(
                f"max_content_bytes={self.max_content_bytes} must not exceed "
                f"max_record_bytes={self.max_record_bytes} (the content is part of the record)"
            )
        try:
            re.compile(self.reply_topic_pattern)
        except re.error as exc:
            raise ValueError(
                f"reply_topic_pattern={self.reply_topic_pattern!r} is not a regular expression: {exc}"
            ) from None
        if self.model == "hf" and not self.model_path:
            raise ValueError(f"model={self.model!r} needs model_path (SURGE_MODEL_PATH), got None")
        if self.model == "remote" and not self.remote_base_url:
            raise ValueError(f"model={self.model!r} needs remote_base_url, got None")
        if (
            self.risk_review_score is not None
            and self.risk_decline_score is not None
            and self.risk_review_score >= self.risk_decline_score
        ):
            raise ValueError(
                f"risk_review_score={self.risk_review_score} must be below "
                f"risk_decline_score={self.risk_decline_score}"
            )
        if self.risk_escalation_wait_max_ms < self.risk_escalation_budget_ms:
            raise ValueError(
                f"risk_escalation_wait_max_ms={self.risk_escalation_wait_max_ms} must be at least "
                f"risk_escalation_budget_ms={self.risk_escalation_budget_ms}"
            )
        if self.risk_escalation_enabled:
            self._check_escalation_reply_topic()
        if self.risk_escalation_enabled and self.risk_escalation_key is None:
            raise ValueError(
                "risk_escalation_enabled needs risk_escalation_key (SURGE_RISK_ESCALATION_KEY): escalation "
                "request ids are derived from it"
            )
        self._check_security()
        return self

    def _check_degrade_thresholds(self) -> None:
        """The degradation controller's own checks (thresholds increase with the level), at load:
        a worker refused them only when it built the controller, naming no setting."""
        from pipeline.exceptions import SurgeError
        from pipeline.inference_config import degrade_config

        try:
            degrade_config(self)
        except SurgeError as exc:
            raise ValueError(f"degrade_{exc}") from None

    def _check_escalation_reply_topic(self) -> None:
        """The request path must reply on the escalation reply topic; a name its reply_to policy
        refuses would leave every escalation unanswered, each one a wait of the SLA."""
        from pipeline.exceptions import InvalidRequestError
        from pipeline.replyto import ReplyToPolicy
        from pipeline.topics import TopicNames

        policy = ReplyToPolicy(TopicNames(self.topic_prefix), self.app_id, self.reply_topic_pattern)
        try:
            policy.resolve(self.risk_escalation_replies)
        except InvalidRequestError as exc:
            raise ValueError(f"risk_escalation_reply_topic: {exc.message}") from None

    def _check_security(self) -> None:
        from pipeline.auth import parse_api_keys
        from pipeline.exceptions import ApiKeyConfigError

        try:
            keys = parse_api_keys(self.api_keys)
        except ApiKeyConfigError as exc:
            raise ValueError(exc.message) from exc
        if self.kafka_request_auth == "signed" and not keys:
            raise ValueError(
                "kafka_request_auth='signed' needs api_keys (SURGE_API_KEYS): a signed record names one "
                "of its keys; set them, or kafka_request_auth='open' for development"
            )
        if self.requests_signed and self.signed_request_max_age_s > self.reply_record_ttl_s:
            # a copy written again inside the window must still meet its recorded reply
            raise ValueError(
                f"signed_request_max_age_s={self.signed_request_max_age_s:g} exceeds "
                f"reply_record_ttl_s={self.reply_record_ttl_s:g}: a signed record written again after "
                "its reply was forgotten but within the age limit would be served a second time"
            )
        if self.risk_escalation_key is not None:
            shared = [i + 1 for i, k in enumerate(keys) if k.tenant == self.risk_escalation_tenant]
            if shared:
                # the tenant's rate-limit bucket and cache scope would be the escalations' too: a
                # client flooding it would have every escalation answered rate_limited
                raise ValueError(
                    f"api_keys entries {shared} have tenant {self.risk_escalation_tenant!r}, the risk "
                    "workers' escalation tenant (risk_escalation_tenant); give them another tenant"
                )
        proto = self.kafka_security_protocol
        if proto.startswith("SASL_") and not (self.kafka_sasl_username and self.kafka_sasl_password):
            raise ValueError(
                f"kafka_security_protocol={proto!r} needs kafka_sasl_username and kafka_sasl_password, "
                f"got username={self.kafka_sasl_username!r} and "
                f"{'a' if self.kafka_sasl_password else 'no'} password"
            )
        tls = {
            "kafka_ssl_cafile": self.kafka_ssl_cafile,
            "kafka_ssl_certfile": self.kafka_ssl_certfile,
            "kafka_ssl_keyfile": self.kafka_ssl_keyfile,
        }
        given = [name for name, value in tls.items() if value is not None]
        if given and not proto.endswith("SSL"):
            raise ValueError(
                f"{', '.join(given)} given but kafka_security_protocol={proto!r} does not use TLS "
                "(SSL or SASL_SSL)"
            )
        if self.kafka_ssl_keyfile is not None and self.kafka_ssl_certfile is None:
            raise ValueError(f"kafka_ssl_keyfile={str(self.kafka_ssl_keyfile)!r} needs kafka_ssl_certfile")

    @classmethod
    def load(cls, **overrides: object) -> Settings:
        """Build settings from the environment plus ``overrides`` (CLI flags); typed error on failure."""
        try:
            return cls(**overrides)  # type: ignore[arg-type]
        except EnvParseError as exc:  # a SURGE_* value that is not JSON where a list is expected
            raise SettingsError(
                f"invalid settings: {exc} (a list is given as JSON, e.g. [1, 2, 3])"
            ) from None
        except ValidationError as exc:
            # without the inputs of secrets (API keys, passwords), which pydantic would print
            details = []
            for err in exc.errors(include_url=False):
                field = ".".join(str(p) for p in err["loc"])
                shown = "" if not field or _SECRET_FIELD.search(field) else f" (got {err.get('input')!r:.80})"
                details.append(f"{field or 'settings'}: {err['msg']}{shown}")
            raise SettingsError(f"invalid settings: {'; '.join(details)}") from None

    @cached_property
    def group_id(self) -> str:
        """The Faust app id of this worker's role: its consumer group, and the prefix Faust gives its
        table changelogs. The risk role is a stream application of its own, ``<app_id>-risk``: Faust's
        assignor gives every member of a group the changelogs of the leader's global tables, and a risk
        worker, which has none, crashed on that assignment (a request worker led, a risk worker
        joined); with a risk worker leading, request workers would have lost their global tables'
        partitions (docs/architecture.md, "Risk: the chain")."""
        return f"{self.app_id}-risk" if self.role == "risk" else self.app_id

    @cached_property
    def risk_escalation_replies(self) -> str:
        """The topic escalation replies land on (``risk_escalation_reply_topic``, else
        ``<prefix>replies.risk``)."""
        return self.risk_escalation_reply_topic or f"{self.topic_prefix}replies.risk"

    @cached_property
    def served_model(self) -> str:
        """The name of the served model: what requests and the gateway call it, and part of every
        cache scope (an ``hf`` model is named by its folder, a ``remote`` one by its remote name)."""
        if self.model == "hf" and self.model_path:
            return re.split(r"[\\/]", self.model_path.rstrip("/\\"))[-1] or "hf"
        if self.model == "remote":
            return self.remote_model
        return self.model

    def accepted_models(self) -> frozenset[str]:
        """Names a request's ``model`` field may carry: the served model and ``model_aliases``."""
        aliases = {a.strip() for a in self.model_aliases.split(",") if a.strip()}
        return frozenset({self.served_model, *aliases})

    @cached_property
    def static_instance_id(self) -> str | None:
        """The group.instance.id of this worker, or None without static membership."""
        if not self.static_membership:
            return None
        if self.group_instance_id:
            return self.group_instance_id
        if self.worker_id:
            return f"{self.app_id}-{self.worker_id}"
        import hashlib
        import socket

        where = f"{socket.gethostname()}:{self.data_dir.absolute()}:{self.role}"
        return f"{self.app_id}-{hashlib.sha256(where.encode()).hexdigest()[:12]}"

    @cached_property
    def bootstrap_servers(self) -> str:
        """``host:port,...`` for aiokafka clients."""
        return ",".join(s.split("://", 1)[-1] for s in self.broker.split(","))

    def deadline_ms(self, priority: str) -> int | None:
        """Class deadline in ms, or None for no deadline (always None with deadlines_enabled off)."""
        if not self.deadlines_enabled:
            return None
        value = {
            "realtime": self.deadline_realtime_ms,
            "interactive": self.deadline_interactive_ms,
            "batch": self.deadline_batch_ms,
            "offline": self.deadline_offline_ms,
        }[priority]
        return value or None

    @property
    def requests_signed(self) -> bool:
        """Whether records on the request topic must be signed (``kafka_request_auth``; ``auto``: when
        API keys are configured). A property, not cached: ``model_copy`` would carry a stale value
        (docs/architecture.md, "Tenant isolation")."""
        if self.kafka_request_auth == "auto":
            return bool(self.api_keys.strip())
        return self.kafka_request_auth == "signed"

    def api_key_tenants(self) -> dict[str, str]:
        """``{api_key: tenant}`` parsed from ``api_keys`` (:func:`pipeline.auth.parse_api_keys` has tiers too)."""
        from pipeline.auth import parse_api_keys

        return {k.key: k.tenant for k in parse_api_keys(self.api_keys)}
