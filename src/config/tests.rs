//! The configuration's contract: what loads, to what, and what is refused with which key.

use super::*;

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Writes `text` as `delayd.toml` in a new directory, for `Config::load` to read; the directory goes
/// when the returned handle is dropped.
fn config_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("delayd.toml");
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

/// Loads `text` as the config file, with no variables and no flags.
fn load(text: &str) -> Result<Config, ConfigError> {
    let (_dir, path) = config_file(text);
    Config::load(Some(&path), Vec::new(), &Flags::default())
}

/// Loads the built-in defaults with the variables `vars` set.
fn load_env(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
    Config::load(None, env(vars), &Flags::default())
}

#[test]
fn durations() {
    assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
    assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
    assert!(parse_duration("30").is_err());
    assert!(parse_duration("1.5s").is_err());
    assert!(parse_duration("s").is_err());
    // In a row, largest first, as people write them.
    assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
    assert_eq!(parse_duration("1d12h"), Ok(Duration::from_secs(36 * 3600)));
    assert_eq!(
        parse_duration("2h0m5s250ms"),
        Ok(Duration::from_millis(7_205_250))
    );
    assert!(parse_duration("1m30").unwrap_err().contains("has no unit"));
    assert!(parse_duration("30s1m")
        .unwrap_err()
        .contains("largest first"));
    assert!(parse_duration("1m1m").is_err());
    assert!(parse_duration("1m 30s").is_err());
    assert!(parse_duration("").is_err());
    assert!(parse_duration("213503982334d23h59m59s")
        .unwrap_err()
        .contains("too long"));
    assert!(parse_duration("99999999999999999999d").is_err());
}

#[test]
fn embedded_defaults() {
    let config = Config::load(None, Vec::new(), &Flags::default()).unwrap();
    assert_eq!(config.listen, "127.0.0.1:7070");
    assert_eq!(config.data_dir, PathBuf::from("./data"));
    assert_eq!(config.delay_levels.len(), 18);
    assert_eq!(config.delay_levels[17].0, Duration::from_secs(7200));
    assert_eq!(config.sinks["broker"].policy().max_batch, 1024);
    let webhook = SinkConfig {
        kind: SinkKind::Webhook(Default::default()),
        ..SinkConfig::default()
    };
    assert_eq!(webhook.policy().max_batch, 256);
    let mut set = SinkConfig::default();
    set.lane.max_batch = Some(7);
    assert_eq!(set.policy().max_batch, 7);
    assert_eq!(config.limits.header_timeout.0, Duration::from_secs(10));
    assert_eq!(config.limits.body_timeout.0, Duration::from_secs(30));
    assert_eq!(config.limits.idle_timeout.0, Duration::from_secs(60));
    assert_eq!(config.limits.max_connections, 1024);
    assert_eq!(config.reserved_fds(), 256);
}

/// The default reserve grows with what the webhook sinks may have open at once; a set one is kept.
#[test]
fn reserved_fds_cover_webhook_calls() {
    let (_dir, path) = config_file(
        "[sinks.billing]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\nmax_in_flight = 2\nmax_batch = 10\n",
    );
    let config = Config::load(Some(&path), Vec::new(), &Flags::default()).unwrap();
    assert_eq!(config.reserved_fds(), 256 + 20);
    let config = Config::load(
        Some(&path),
        env(&[
            ("DELAYD_RESERVED_FDS", "64"),
            ("DELAYD_MAX_CONNECTIONS", "10"),
        ]),
        &Flags::default(),
    )
    .unwrap();
    assert_eq!(
        (config.reserved_fds(), config.limits.max_connections),
        (64, 10)
    );
}

/// `deploy/delayd.toml`, the example operators copy, loads to exactly the built-in defaults and
/// names every key (the optional ones, and those of sinks and sources, commented out).
#[test]
fn the_example_config_is_every_key_at_its_default() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/delayd.toml");
    let example = Config::load(
        Some(std::path::Path::new(path)),
        Vec::new(),
        &Flags::default(),
    )
    .unwrap();
    let builtin = Config::load(None, Vec::new(), &Flags::default()).unwrap();
    assert_eq!(format!("{example:?}"), format!("{builtin:?}"));
    let text = std::fs::read_to_string(path).unwrap();
    let keys: std::collections::BTreeSet<&str> = text
        .lines()
        .map(|line| line.trim_start_matches(['#', ' ']))
        .filter_map(|line| line.split_once(" = ").map(|(key, _)| key.trim()))
        .collect();
    // The field names a Debug rendering shows: `name: value`.
    let fields = |debug: String| -> Vec<String> {
        debug
            .match_indices(": ")
            .map(|(at, _)| {
                let before = &debug[..at];
                let start = before
                    .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .map_or(0, |i| i + 1);
                before[start..].to_string()
            })
            .collect()
    };
    let mut all = fields(format!("{:?}", Config::default()));
    use crate::setting::keys_of;
    for keys in [
        keys_of::<crate::sink::LaneConfig>(),
        keys_of::<crate::broker::BrokerSinkConfig>(),
        keys_of::<crate::sink::webhook::WebhookSinkConfig>(),
        keys_of::<crate::sink::MqSinkConfig>(),
        keys_of::<crate::sink::amqp::AmqpSinkConfig>(),
        keys_of::<crate::source::SourceShared>(),
        keys_of::<crate::source::redis::RedisSourceConfig>(),
        keys_of::<crate::source::nats::NatsSourceConfig>(),
        keys_of::<crate::source::amqp::AmqpSourceConfig>(),
        keys_of::<crate::source::kafka::KafkaSourceConfig>(),
        keys_of::<ClusterConfig>(),
        keys_of::<MemberConfig>(),
    ] {
        all.extend(keys.iter().map(|key| key.to_string()));
    }
    all.push("kind".into());
    let nested = [
        "limits",
        "auth",
        "broker",
        "sinks",
        "sources",
        "cluster",
        "members",
        "written_sinks",
        "written_sources",
    ];
    for field in all.iter().filter(|f| !nested.contains(&f.as_str())) {
        assert!(
            keys.contains(field.as_str()),
            "deploy/delayd.toml lacks {field}"
        );
    }
    assert!(all.len() > 50, "{all:?}");
}

#[test]
fn kubernetes_service_links_are_not_taken_for_settings() {
    // What a pod sees for a Service named `delayd` (its port named http).
    let links = env(&[
        ("DELAYD_SERVICE_HOST", "10.0.0.7"),
        ("DELAYD_SERVICE_PORT", "7070"),
        ("DELAYD_SERVICE_PORT_HTTP", "7070"),
        ("DELAYD_PORT", "tcp://10.0.0.7:7070"),
        ("DELAYD_PORT_7070_TCP", "tcp://10.0.0.7:7070"),
        ("DELAYD_PORT_7070_TCP_PROTO", "tcp"),
        ("DELAYD_PORT_7070_TCP_PORT", "7070"),
        ("DELAYD_PORT_7070_TCP_ADDR", "10.0.0.7"),
        // Services named `delayd-service` and `delayd-port`.
        ("DELAYD_SERVICE_SERVICE_HOST", "10.0.0.8"),
        ("DELAYD_SERVICE_PORT", "tcp://10.0.0.8:7070"),
        ("DELAYD_PORT_PORT", "tcp://[fd00::9]:7070"),
        ("DELAYD_PORT_PORT_7070_TCP_ADDR", "fd00::9"),
        ("DELAYD_LISTEN", "0.0.0.0:7070"),
    ]);
    let config = Config::load(None, links, &Flags::default()).unwrap();
    assert_eq!(config.listen, "0.0.0.0:7070");
    // A misspelt setting is still refused.
    for key in [
        "DELAYD_LISTEN_ADDR",
        "DELAYD_PORTS",
        "DELAYD_PORT_HTTP",
        "DELAYD_SERVICE",
    ] {
        let error = load_env(&[(key, "1")]).unwrap_err();
        assert!(error.to_string().contains(key), "{key}: {error}");
    }
}

#[test]
fn file_then_env_then_flags() {
    let (_dir, path) = config_file(
        "listen = \"127.0.0.1:1\"\nfsync = \"5ms\"\nmax_delay = \"3d\"\n[limits]\nmax_message_bytes = 1000\n",
    );
    let env = env(&[("DELAYD_LISTEN", "127.0.0.1:2"), ("HOME", "/root")]);
    let flags = Flags {
        data_dir: Some("/tmp/x".into()),
        ..Flags::default()
    };
    let config = Config::load(Some(&path), env.clone(), &flags).unwrap();
    assert_eq!(config.listen, "127.0.0.1:2");
    assert_eq!(config.data_dir, PathBuf::from("/tmp/x"));
    assert_eq!(config.max_delay.0, Duration::from_secs(3 * 86_400));
    assert_eq!(config.limits.max_message_bytes, 1000);
    assert_eq!(
        config.fsync_policy().unwrap(),
        schedulelog::FsyncPolicy::Interval(Duration::from_millis(5))
    );
    let flags = Flags {
        listen: Some("127.0.0.1:3".into()),
        ..Flags::default()
    };
    assert_eq!(
        Config::load(Some(&path), env, &flags).unwrap().listen,
        "127.0.0.1:3"
    );
}

#[test]
fn mistakes_are_named() {
    let err = load("lisen = \"x\"\n").unwrap_err();
    assert!(err.to_string().contains("lisen"), "{err}");
    // Each error starts with its key, or with the variable where the value cannot be read or the
    // variable is no setting.
    for (var, value, key) in [
        ("DELAYD_SEGMENT_MINUTES", "90", "segment_minutes"),
        ("DELAYD_FSYNC", "sometimes", "fsync"),
        (
            "DELAYD_MIN_FREE_DISK_BYTES",
            "1000",
            "limits.min_free_disk_bytes",
        ),
        ("DELAYD_BROKER_RETENTION", "0s", "broker.retention"),
        ("DELAYD_HEADER_TIMEOUT", "0s", "limits.header_timeout"),
        ("DELAYD_BODY_TIMEOUT", "2h", "limits.body_timeout"),
        ("DELAYD_IDLE_TIMEOUT", "50ms", "limits.idle_timeout"),
        ("DELAYD_MAX_CONNECTIONS", "0", "limits.max_connections"),
        ("DELAYD_RESERVED_FDS", "8", "limits.reserved_fds"),
        ("DELAYD_HEADER_TIMEOUT", "10", "DELAYD_HEADER_TIMEOUT"),
        ("DELAYD_NOPE", "1", "DELAYD_NOPE"),
    ] {
        let err = load_env(&[(var, value)]).unwrap_err();
        assert!(err.to_string().starts_with(key), "{var}={value}: {err}");
    }
    let err = load("[sinks.billing]\nkind = \"carrier-pigeon\"\n").unwrap_err();
    assert!(err.to_string().contains("carrier-pigeon"), "{err}");
}

#[test]
fn nats_sources_and_sinks_are_checked() {
    let sink = "[sinks.out]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\n";
    let load_source = |source: &str| {
        load(&format!(
            "{sink}[sources.in]\nkind = \"nats\"\nsink = \"out\"\n{source}"
        ))
    };
    let good = "url = \"nats://127.0.0.1:4222\"\nstream = \"DELAYS\"\nsubject = \"delayd.>\"\n";
    let config = load_source(good).unwrap();
    assert!(config.sinks["out"].topic_is_target());
    match &config.sources["in"].kind {
        SourceKind::Nats(nats) => assert_eq!(nats.group, "delayd"),
        other => panic!("{other:?}"),
    }
    for (source, key) in [
        (
            "url = \"nats://127.0.0.1:4222\"\nstream = \"DELAYS\"\nsubject = \"delayd.>\"\nqueue = \"q\"\n",
            "sources.in.queue",
        ),
        (
            "stream = \"DELAYS\"\nsubject = \"delayd.>\"\n",
            "sources.in",
        ),
        (
            "url = \"nats://127.0.0.1:4222\"\nsubject = \"delayd.>\"\n",
            "sources.in.stream",
        ),
        (
            "url = \"nats://127.0.0.1:4222\"\nstream = \"DE.LAYS\"\nsubject = \"delayd.>\"\n",
            "sources.in.stream",
        ),
        (
            "url = \"nats://127.0.0.1:4222\"\nstream = \"DELAYS\"\n",
            "sources.in.subject",
        ),
        (
            "url = \"nats://127.0.0.1:4222\"\nstream = \"DELAYS\"\nsubject = \"delayd.>.x\"\n",
            "sources.in.subject",
        ),
        (
            "url = \"nats://127.0.0.1:4222\"\nstream = \"DELAYS\"\nsubject = \"delayd..x\"\n",
            "sources.in.subject",
        ),
        (&format!("{good}group = \"a.b\"\n"), "sources.in.group"),
        (
            &format!("{good}ack_wait = \"10ms\"\n"),
            "sources.in.ack_wait",
        ),
        (
            &format!("{good}stream_key = \"x\"\n"),
            "sources.in.stream_key",
        ),
    ] {
        let err = load_source(source).unwrap_err();
        assert!(err.to_string().starts_with(key), "{source}: {err}");
    }
    // Each MQ sink without a url is told what one looks like.
    for (kind, example) in [
        ("nats", "nats://host:4222"),
        ("redis", "redis://host:6379/"),
        ("amqp", "amqp://user:password@host:5672/vhost"),
        ("kafka", "kafka://host:9092"),
    ] {
        let err = load(&format!("[sinks.out]\nkind = \"{kind}\"\n")).unwrap_err();
        let article = crate::setting::article(kind);
        assert_eq!(
            err.to_string(),
            format!("sinks.out: {article} {kind} sink needs a url ({example}) and takes no secret"),
        );
    }
}

#[test]
fn amqp_sources_and_sinks() {
    let good = "[sinks.out]\nkind = \"amqp\"\nurl = \"amqp://guest:guest@127.0.0.1:5672/%2f\"\nexchange = \"\"\n\n\
                [sources.in]\nkind = \"amqp\"\nurl = \"amqp://guest:guest@127.0.0.1:5672/%2f\"\nqueue = \"delayd.in\"\nsink = \"out\"\nbatch = 64\n";
    let config = load(good).unwrap();
    assert!(config.sinks["out"].topic_is_target());
    match &config.sources["in"].kind {
        SourceKind::Amqp(amqp) => assert_eq!(amqp.queue.as_deref(), Some("delayd.in")),
        other => panic!("{other:?}"),
    }
    assert_eq!(config.sources["in"].shared.batch, 64);
    assert_edits_refused(
        good,
        &[
            (
                "batch = 64",
                "batch = 64\nsubject = \"x.>\"",
                "sources.in.subject",
            ),
            ("queue = \"delayd.in\"\n", "", "sources.in.queue"),
            (
                "queue = \"delayd.in\"",
                "queue = \"amq.x\"",
                "sources.in.queue",
            ),
            (
                "queue = \"delayd.in\"",
                "queue = \"a b\"",
                "sources.in.queue",
            ),
            (
                "amqp://guest:guest@127.0.0.1:5672/%2f\"\nqueue",
                "amqps://127.0.0.1/\"\nqueue",
                "sources.in.url",
            ),
            (
                "exchange = \"\"",
                "exchange = \"no spaces\"",
                "sinks.out.exchange",
            ),
            (
                "amqp://guest:guest@127.0.0.1:5672/%2f\"\nexchange",
                "http://x/\"\nexchange",
                "sinks.out.url",
            ),
            ("queue = \"delayd.in\"", "stream_key = \"s\"", "sources.in"),
        ],
    );
    let err = load("[sinks.out]\nkind = \"webhook\"\nurl = \"http://x/\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\nexchange = \"e\"\n").unwrap_err();
    assert!(err.to_string().starts_with("sinks.out.exchange"), "{err}");
}

/// Loads `good` with each edit (`from` replaced by `to`) in turn, and asserts that the edit is refused
/// with an error starting with `key`.
fn assert_edits_refused(good: &str, edits: &[(&str, &str, &str)]) {
    for (from, to, key) in edits {
        let bad = good.replace(from, to);
        let err = load(&bad).unwrap_err();
        assert!(err.to_string().starts_with(key), "{bad}: {err}");
    }
}

/// Nodes sharing a Redis group each need a consumer name of their own: no default.
#[test]
fn a_redis_source_names_this_nodes_consumer() {
    let good = "[sinks.out]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:6379/\"\n\n\
                [sources.in]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:6379/\"\nstream_key = \"in\"\nsink = \"out\"\nconsumer = \"node-1\"\n";
    match &load(good).unwrap().sources["in"].kind {
        SourceKind::Redis(redis) => assert_eq!(redis.consumer.as_deref(), Some("node-1")),
        other => panic!("{other:?}"),
    }
    for (bad, why) in [
        (
            good.replace("consumer = \"node-1\"\n", ""),
            "needs consumer",
        ),
        (
            good.replace("consumer = \"node-1\"", "consumer = \"a b\""),
            "a consumer name",
        ),
    ] {
        let err = load(&bad).unwrap_err().to_string();
        assert!(
            err.starts_with("sources.in.consumer") && err.contains(why),
            "{err}"
        );
    }
}

#[test]
fn kafka_sources_and_sinks() {
    let good = "[sinks.out]\nkind = \"kafka\"\nurl = \"kafka://127.0.0.1:9092,127.0.0.2:9092\"\n\n\
                [sources.in]\nkind = \"kafka\"\nurl = \"kafka://127.0.0.1:9092\"\ntopics = [\"delayd-in\"]\nsink = \"out\"\nconsumer = \"node-1\"\n";
    let config = load(good).unwrap();
    assert!(
        !config.sinks["out"].topic_is_target(),
        "targets are topic names"
    );
    match &config.sources["in"].kind {
        SourceKind::Kafka(kafka) => assert_eq!(kafka.topics, ["delayd-in"]),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        crate::mq::kafka::bootstrap_servers("kafka://127.0.0.1:9092,127.0.0.2:9092").unwrap(),
        "127.0.0.1:9092,127.0.0.2:9092"
    );
    assert_edits_refused(
        good,
        &[
            ("topics = [\"delayd-in\"]\n", "", "sources.in.topics"),
            ("[\"delayd-in\"]", "[\"no spaces\"]", "sources.in.topics"),
            (
                "kafka://127.0.0.1:9092\"\ntopics",
                "kafka://127.0.0.1\"\ntopics",
                "sources.in.url",
            ),
            ("consumer = \"node-1\"", "consumer = \"a/b\"", "sources.in"),
            ("consumer = \"node-1\"\n", "", "sources.in.consumer"),
            (
                "sink = \"out\"",
                "sink = \"out\"\nqueue = \"q\"",
                "sources.in.queue",
            ),
            (
                "kafka://127.0.0.1:9092,127.0.0.2:9092",
                "redis://x/",
                "sinks.out.url",
            ),
        ],
    );
    // topics belong to kafka sources only.
    let err = load("[sinks.out]\nkind = \"redis\"\nurl = \"redis://127.0.0.1/\"\n\n[sources.in]\nkind = \"redis\"\nurl = \"redis://127.0.0.1/\"\nstream_key = \"s\"\ntopics = [\"t\"]\nsink = \"out\"\n").unwrap_err();
    assert!(err.to_string().starts_with("sources.in.topics"), "{err}");
}

#[test]
fn backoff_caps_stay_within_max_delay() {
    let config = load_env(&[("DELAYD_MAX_DELAY", "10m")]).unwrap();
    assert_eq!(
        config.sinks["broker"].lane.backoff_cap.0,
        Duration::from_secs(600)
    );
}

/// Each kind takes its own keys and those every table takes: anything else is refused, naming the key
/// and listing the valid ones; so is an unknown kind, listing the kinds.
#[test]
fn unknown_keys_and_kinds_are_refused_with_the_valid_ones() {
    let hook = "[sinks.hooks]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\n";
    let source = "[sources.in]\nkind = \"redis\"\nurl = \"redis://127.0.0.1/\"\nstream_key = \"s\"\nsink = \"hooks\"\nconsumer = \"node-1\"\n";
    load(&format!("{hook}{source}")).unwrap();
    for (text, key, listed) in [
        (format!("{hook}retries = 3\n"), "sinks.hooks.retries", "a webhook sink has no such key; its keys are kind, max_attempts, rate_per_sec, burst, max_in_flight, max_batch, backoff_initial, backoff_multiplier, backoff_cap, url, secret, timeout, ca_file"),
        ("[sinks.tuned]\nmax_attempt = 3\n".into(), "sinks.tuned.max_attempt", "a broker sink has no such key"),
        ("[sinks.out]\nkind = \"kafka\"\nurl = \"kafka://k:9092\"\nexchange = \"x\"\n".into(), "sinks.out.exchange", "a kafka sink has no such key; its keys are kind, max_attempts"),
        (format!("{hook}{source}bogus = 1\n"), "sources.in.bogus", "a redis source has no such key; its keys are kind, sink, batch, url, stream_key, group, consumer"),
        (format!("{hook}{}", source.replace("redis\"", "nats\"")), "sources.in.stream_key", "a nats source has no such key"),
    ] {
        let err = load(&text).unwrap_err().to_string();
        assert!(err.starts_with(key) && err.contains(listed), "{text}: {err}");
    }
    for (text, key, kinds) in [
        (
            "[sinks.billing]\nkind = \"carrier-pigeon\"\n",
            "sinks.billing.kind",
            &SINK_KINDS[..],
        ),
        ("[sinks.billing]\nkind = 7\n", "sinks.billing.kind", &[][..]),
        (
            "[sources.in]\nkind = \"sqs\"\nsink = \"broker\"\n",
            "sources.in.kind",
            &SOURCE_KINDS[..],
        ),
        (
            "[sources.in]\nsink = \"broker\"\n",
            "sources.in.kind",
            &SOURCE_KINDS[..],
        ),
    ] {
        let err = load(text).unwrap_err().to_string();
        assert!(err.starts_with(key), "{text}: {err}");
        for kind in kinds {
            assert!(err.contains(&format!("\"{kind}\"")), "{text}: {err}");
        }
    }
    assert!(load("[sinks.billing]\nkind = \"carrier-pigeon\"\n")
        .unwrap_err()
        .to_string()
        .ends_with("unknown sink kind \"carrier-pigeon\": use \"broker\", \"webhook\", \"redis\", \"nats\", \"amqp\" or \"kafka\""));
    // A value of the wrong type names its key.
    for (text, key) in [
        (
            format!("{hook}max_attempts = \"x\"\n"),
            "sinks.hooks.max_attempts",
        ),
        (format!("{hook}timeout = \"soon\"\n"), "sinks.hooks.timeout"),
        (
            "[sinks.out]\nkind = \"nats\"\nurl = \"nats://n:4222\"\ntargets = [\"a\", 2]\n".into(),
            "sinks.out.targets[1]",
        ),
        (
            format!(
                "{hook}{}",
                source.replace("node-1\"", "node-1\"\nbatch = \"many\"")
            ),
            "sources.in.batch",
        ),
    ] {
        let err = load(&text).unwrap_err().to_string();
        assert!(err.starts_with(key), "{text}: {err}");
    }
}

/// Keys every sink (`timeout`, `ca_file`) or every source (`group`, `consumer`, `ack_wait`) took before
/// each kind had its own are still accepted by the kinds that ignore them, and still type-checked.
#[test]
fn keys_every_table_once_took_still_load() {
    let text = "[sinks.out]\nkind = \"redis\"\nurl = \"redis://127.0.0.1/\"\ntimeout = \"5s\"\nca_file = \"/nowhere.pem\"\n\n\
                [sinks.broker]\ntimeout = \"5s\"\n\n\
                [sources.in]\nkind = \"amqp\"\nurl = \"amqp://127.0.0.1:5672/%2f\"\nqueue = \"q\"\nsink = \"out\"\ngroup = \"g\"\nconsumer = \"c\"\nack_wait = \"5s\"\n";
    let config = load(text).unwrap();
    assert_eq!(config.sinks["out"].kind.name(), "redis");
    assert_eq!(config.sources["in"].kind.name(), "amqp");
    let err = load(&text.replace("timeout = \"5s\"\nca_file", "timeout = \"soon\"\nca_file"))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("sinks.out.timeout"), "{err}");
    let err = load(&text.replace("ack_wait = \"5s\"", "ack_wait = true"))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("sources.in.ack_wait"), "{err}");
    // Lists a kind does not take load when empty (as a template writes them), and are refused
    // otherwise.
    let empty = text
        .replace(
            "[sinks.broker]\n",
            "[sinks.broker]\ntargets = []\nexchanges = []\n",
        )
        .replace("sink = \"out\"\n", "sink = \"out\"\ntopics = []\n");
    load(&empty).unwrap();
    let err = load(&empty.replace("targets = []", "targets = [\"a.*\"]"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("sinks.broker.targets") && err.contains("only an MQ sink"),
        "{err}"
    );
    let err = load(&empty.replace("exchanges = []", "exchanges = [\"x\"]"))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("sinks.broker.exchanges"), "{err}");
    let err = load(&empty.replace("topics = []", "topics = [\"t\"]"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("sources.in.topics") && err.contains("an amqp source has no topics"),
        "{err}"
    );
}

/// The `DELAYD_*` variables (and Kubernetes' service links beside them) apply over a file with sinks
/// and sources, and what the tables depend on (`max_delay` capping each sink's backoff) follows them.
#[test]
fn env_overrides_apply_over_sink_and_source_tables() {
    let (_dir, path) = config_file(
        "max_delay = \"2h\"\n[sinks.out]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\nbackoff_cap = \"1h\"\n\n\
         [sources.in]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\nstream = \"S\"\nsubject = \"s.>\"\nsink = \"out\"\n",
    );
    let vars = env(&[
        ("DELAYD_MAX_DELAY", "10m"),
        ("DELAYD_LISTEN", "127.0.0.1:9"),
        ("DELAYD_SERVICE_HOST", "10.0.0.7"),
        ("DELAYD_PORT_7070_TCP", "tcp://10.0.0.7:7070"),
    ]);
    let config = Config::load(Some(&path), vars, &Flags::default()).unwrap();
    assert_eq!(config.listen, "127.0.0.1:9");
    assert_eq!(
        config.sinks["out"].lane.backoff_cap.0,
        Duration::from_secs(600)
    );
    assert_eq!(
        config.sinks["broker"].lane.backoff_cap.0,
        Duration::from_secs(600)
    );
    assert_eq!(config.sources["in"].shared.sink.as_deref(), Some("out"));
    let err = Config::load(
        Some(&path),
        env(&[("DELAYD_SINKS_OUT_URL", "x")]),
        &Flags::default(),
    )
    .unwrap_err();
    assert!(err.to_string().starts_with("DELAYD_SINKS_OUT_URL"), "{err}");
}

/// The three-member cluster of DESIGN.md §10, as member 1 writes it.
const CLUSTER: &str = r#"
[cluster]
node_id = 1
listen = "127.0.0.1:7171"            # peer traffic (Raft RPCs, snapshots)
secret = "a long random string"        # required; the same on every member
election_timeout = "1s"               # heartbeats at a quarter of it
[[cluster.members]]
id = 1
api = "http://127.0.0.1:7071"          # the member's client listener (followers forward here)
peer = "127.0.0.1:7171"
[[cluster.members]]
id = 2
api = "http://127.0.0.1:7072"
peer = "127.0.0.1:7172"
[[cluster.members]]
id = 3
api = "http://127.0.0.1:7073"
peer = "127.0.0.1:7173"
"#;

#[test]
fn a_cluster_of_three_loads() {
    let config = load(CLUSTER).unwrap();
    let cluster = config.cluster.as_ref().unwrap();
    assert_eq!(cluster.node_id, 1);
    assert_eq!(cluster.listen, "127.0.0.1:7171");
    assert_eq!(cluster.secret, "a long random string");
    assert_eq!(cluster.election_timeout.0, Duration::from_secs(1));
    let ids: Vec<u64> = cluster.members.iter().map(|m| m.id).collect();
    assert_eq!(ids, [1, 2, 3]);
    assert_eq!(
        cluster.member(2),
        Some(&MemberConfig {
            id: 2,
            api: "http://127.0.0.1:7072".into(),
            peer: "127.0.0.1:7172".into(),
        })
    );
    assert_eq!(cluster.member(4), None);
    assert_eq!(cluster.this_member().api, "http://127.0.0.1:7071");
    // The secret stays out of Debug output, and so out of any log of the configuration.
    let debug = format!("{config:?}");
    assert!(
        !debug.contains("a long random string") && debug.contains("secret: (20 bytes)"),
        "{debug}"
    );
    // election_timeout has its default; host names, IPv6 addresses, https and default ports do.
    let written = CLUSTER
        .replace("election_timeout = \"1s\"", "")
        .replace(
            "127.0.0.1:7172",
            "delayd-1.delayd.default.svc.cluster.local:7171",
        )
        .replace("http://127.0.0.1:7072", "https://delayd-1.delayd/")
        .replace("127.0.0.1:7173", "[fd00::3]:7171")
        .replace("http://127.0.0.1:7073", "http://[fd00::3]");
    let cluster = load(&written).unwrap().cluster.unwrap();
    assert_eq!(cluster.election_timeout.0, Duration::from_secs(1));
    assert_eq!(cluster.members[2].peer, "[fd00::3]:7171");
}

#[test]
fn no_cluster_section_is_a_single_node() {
    assert_eq!(load("listen = \"127.0.0.1:7070\"\n").unwrap().cluster, None);
    assert_eq!(load_env(&[]).unwrap().cluster, None);
    assert_eq!(Config::default().cluster, None);
}

/// Each mistake in `[cluster]` is refused with its key and a way out, word for word.
#[test]
fn cluster_mistakes_are_refused_with_the_fix() {
    // The §10 example with `from` replaced by `to`, refused: why.
    let refused = |from: &str, to: &str| {
        let text = CLUSTER.replace(from, to);
        assert_ne!(text, CLUSTER, "{from:?} is not in the example");
        load(&text).unwrap_err().to_string()
    };
    let host_port = "such as \"10.0.0.1:7171\", \"[fd00::1]:7171\" or \"delayd-1.delayd:7171\"";
    let url = "such as \"http://10.0.0.1:7070\"";

    assert_eq!(
        refused("node_id = 1\n", ""),
        "cluster.node_id: required: this member's id, one of the ids in [[cluster.members]] (a \
         whole number above 0; DELAYD_CLUSTER_NODE_ID sets it per member)"
    );
    assert_eq!(
        refused("node_id = 1", "node_id = 4"),
        "cluster.node_id: 4 is not among the members' ids (1, 2, 3): set it to this member's own id"
    );

    let timeout = "election_timeout = \"1s\"";
    assert_eq!(
        refused(timeout, "election_timeout = \"1s\"\nsnapshot_entries = 10"),
        "cluster.snapshot_entries: must be between 100 and 100000000 (5000 is the default)"
    );
    for bytes in ["4096", "65537", "2147483648"] {
        assert_eq!(
            refused(
                timeout,
                &format!("election_timeout = \"1s\"\nlog_file_bytes = {bytes}")
            ),
            "cluster.log_file_bytes: must be a multiple of 4096 between 65536 and 1073741824 \
             (67108864, 64 MiB, is the default)"
        );
    }

    let listen = "listen = \"127.0.0.1:7171\"";
    assert_eq!(
        refused(listen, ""),
        "cluster.listen: required: this member's peer listener as host:port, such as \
         \"0.0.0.0:7171\", where the other members' Raft RPCs arrive"
    );
    assert_eq!(
        refused(listen, "listen = \"127.0.0.1\""),
        format!("cluster.listen: \"127.0.0.1\" has no port: write host:port {host_port}")
    );
    assert_eq!(
        refused(listen, "listen = \"0.0.0.0:0\""),
        format!(
            "cluster.listen: \"0.0.0.0:0\": \"0\" is not a port (1 to 65535); write host:port \
             {host_port}"
        )
    );

    let secret = "secret = \"a long random string\"";
    let required = "cluster.secret: required, the same on every member: a random string of at \
                    least 16 bytes, such as the output of `openssl rand -hex 32` (set \
                    DELAYD_CLUSTER_SECRET rather than write it in the file)";
    assert_eq!(refused(secret, ""), required);
    assert_eq!(refused(secret, "secret = \"\""), required);
    assert_eq!(
        refused(secret, "secret = \"fifteen bytes..\""),
        "cluster.secret: 15 bytes is too short: use a random string of at least 16 bytes, the \
         same on every member, such as the output of `openssl rand -hex 32`"
    );

    let timeout = "election_timeout = \"1s\"";
    for too_short_or_long in ["election_timeout = \"99ms\"", "election_timeout = \"61s\""] {
        assert_eq!(
            refused(timeout, too_short_or_long),
            "cluster.election_timeout: must be between 100ms and 60s (heartbeats go at a quarter \
             of it; \"1s\" suits a local network)"
        );
    }

    let members = &CLUSTER[CLUSTER.find("[[cluster.members]]").unwrap()..];
    assert_eq!(
        refused(members, ""),
        "cluster.members: at least one member is required: a [[cluster.members]] table with id, \
         api and peer for every member, this one included, the same on every member"
    );
    for no_id in ["id = 0\n", ""] {
        assert_eq!(
            refused("id = 3\n", no_id),
            "cluster.members[2].id: required: a whole number above 0, each member's its own"
        );
    }
    assert_eq!(
        refused("id = 3\n", "id = 1\n"),
        "cluster.members[2].id: 1 is also the id of cluster.members[0]: give each member an id of \
         its own"
    );

    let api = "http://127.0.0.1:7072";
    assert_eq!(
        refused(&format!("api = \"{api}\""), ""),
        "cluster.members[1].api: required: the member's client listener as an http:// or https:// \
         URL, such as \"http://10.0.0.1:7070\""
    );
    assert_eq!(
        refused(api, "127.0.0.1:7072"),
        format!(
            "cluster.members[1].api: \"127.0.0.1:7072\" is not a URL (relative URL without a \
             base): write one {url}"
        )
    );
    assert_eq!(
        refused(api, "ftp://127.0.0.1:7072"),
        format!(
            "cluster.members[1].api: \"ftp://127.0.0.1:7072\": use an http:// or https:// URL, \
             {url}"
        )
    );
    for beyond in ["/v1", "/?a=b", "/#top"] {
        assert_eq!(
            refused(api, &format!("{api}{beyond}")),
            format!(
                "cluster.members[1].api: \"{api}{beyond}\" has a path, a query or a fragment: give \
                 only the scheme, host and port, {url} (followers add the request's own path)"
            )
        );
    }
    assert_eq!(
        refused(api, "http://me:pw@127.0.0.1:7072"),
        format!(
            "cluster.members[1].api: \"http://me:pw@127.0.0.1:7072\" has a user name or password: \
             give only the scheme, host and port, {url}"
        )
    );
    // The same listener however it is written: scheme and host in any case, the default port.
    assert_eq!(
        refused("http://127.0.0.1:7073", "HTTP://127.0.0.1:7072/"),
        "cluster.members[2].api: \"HTTP://127.0.0.1:7072/\" is also the api of cluster.members[1]: \
         each member has a client listener of its own"
    );
    let text = CLUSTER
        .replace(api, "http://a")
        .replace("http://127.0.0.1:7073", "http://A:80");
    assert_eq!(
        load(&text).unwrap_err().to_string(),
        "cluster.members[2].api: \"http://A:80\" is also the api of cluster.members[1]: each \
         member has a client listener of its own"
    );

    let peer = "127.0.0.1:7173";
    assert_eq!(
        refused(&format!("peer = \"{peer}\""), ""),
        "cluster.members[2].peer: required: the member's peer listener as host:port, such as \
         \"10.0.0.1:7171\" or \"delayd-1.delayd:7171\""
    );
    assert_eq!(
        refused(peer, "127.0.0.1:7172"),
        "cluster.members[2].peer: \"127.0.0.1:7172\" is also the peer of cluster.members[1]: each \
         member has a peer listener of its own"
    );
    assert_eq!(
        refused(peer, "delayd_3"),
        format!("cluster.members[2].peer: \"delayd_3\" has no port: write host:port {host_port}")
    );
    assert_eq!(
        refused(peer, "fd00::3:7171"),
        "cluster.members[2].peer: \"fd00::3:7171\": an IPv6 address goes in brackets, such as \
         \"[fd00::1]:7171\""
    );
    for (written, port) in [("127.0.0.1:71730", "71730"), ("127.0.0.1:+7173", "+7173")] {
        assert_eq!(
            refused(peer, written),
            format!(
                "cluster.members[2].peer: \"{written}\": \"{port}\" is not a port (1 to 65535); \
                 write host:port {host_port}"
            )
        );
    }
    assert_eq!(
        refused(peer, "[fd00::zz]:7171"),
        format!(
            "cluster.members[2].peer: \"[fd00::zz]:7171\": \"fd00::zz\" in brackets is not an IPv6 \
             address; write host:port {host_port}"
        )
    );
    for (written, host) in [
        ("http://h:7171", "http://h"),
        ("-h.x:7171", "-h.x"),
        (":7171", ""),
    ] {
        assert_eq!(
            refused(peer, written),
            format!(
                "cluster.members[2].peer: \"{written}\": \"{host}\" is neither an IP address nor a \
                 host name; write host:port {host_port}"
            )
        );
    }

    // A cluster acknowledges once a majority has synced, never after a periodic sync: refused
    // whether the interval comes from the file, a variable or a flag.
    let interval = "fsync: must be \"always\" with a [cluster] section: a member acknowledges a \
                    write once a majority of the members have fdatasynced it, so a periodic \
                    fdatasync has no place; remove the fsync setting (DELAYD_FSYNC, --fsync) or \
                    set it to \"always\"";
    let err = load(&format!("fsync = \"5ms\"\n{CLUSTER}")).unwrap_err();
    assert_eq!(err.to_string(), interval);
    load(&format!("fsync = \"always\"\n{CLUSTER}")).unwrap();
    let (_dir, path) = config_file(CLUSTER);
    let err = Config::load(
        Some(&path),
        env(&[("DELAYD_FSYNC", "5ms")]),
        &Flags::default(),
    );
    assert_eq!(err.unwrap_err().to_string(), interval);
    let flags = Flags {
        fsync: Some("10ms".into()),
        ..Flags::default()
    };
    let err = Config::load(Some(&path), Vec::new(), &flags).unwrap_err();
    assert_eq!(err.to_string(), interval);
}

/// Unknown keys in `[cluster]` and `[[cluster.members]]` are refused by name, like any other.
#[test]
fn unknown_cluster_keys_are_refused() {
    for (from, to, unknown) in [
        (
            "node_id = 1",
            "node_id = 1\nnodes = 3",
            "unknown field `nodes`, expected one of `node_id`, `listen`, `secret`, \
             `election_timeout`, `snapshot_entries`, `log_file_bytes`, `join`, `members`",
        ),
        (
            "id = 2\n",
            "id = 2\nvoter = true\n",
            "unknown field `voter`, expected one of `id`, `api`, `peer`",
        ),
    ] {
        let text = CLUSTER.replace(from, to);
        let err = load(&text).unwrap_err().to_string();
        assert!(err.contains(unknown), "{text}: {err}");
    }
    let err = load(&CLUSTER.replace("node_id = 1", "node_id = \"one\"")).unwrap_err();
    assert!(err.to_string().contains("node_id = \"one\""), "{err}");
}

/// `DELAYD_CLUSTER_*` override the file, and make the section when it has none (members come only
/// from a file, so validation then asks for the rest).
#[test]
fn cluster_env_overrides() {
    let no_secret = CLUSTER.replace("secret = \"a long random string\"", "");
    let (_dir, path) = config_file(&no_secret);
    let vars = env(&[
        ("DELAYD_CLUSTER_NODE_ID", "3"),
        ("DELAYD_CLUSTER_LISTEN", "0.0.0.0:7173"),
        ("DELAYD_CLUSTER_SECRET", "0123456789abcdef0123456789abcdef"),
        ("DELAYD_CLUSTER_ELECTION_TIMEOUT", "1500ms"),
        ("DELAYD_CLUSTER_SNAPSHOT_ENTRIES", "250"),
        ("DELAYD_CLUSTER_LOG_FILE_BYTES", "1048576"),
        ("DELAYD_CLUSTER_JOIN", "true"),
    ]);
    let cluster = Config::load(Some(&path), vars, &Flags::default())
        .unwrap()
        .cluster
        .unwrap();
    assert_eq!(cluster.node_id, 3);
    assert_eq!(cluster.listen, "0.0.0.0:7173");
    assert_eq!(cluster.secret, "0123456789abcdef0123456789abcdef");
    assert_eq!(cluster.election_timeout.0, Duration::from_millis(1500));
    assert_eq!(
        (cluster.snapshot_entries, cluster.log_file_bytes),
        (250, 1 << 20)
    );
    assert_eq!(cluster.this_member().peer, "127.0.0.1:7173");
    assert_eq!(cluster.members.len(), 3);
    // Without a secret anywhere, the file alone is refused.
    let err = Config::load(Some(&path), Vec::new(), &Flags::default()).unwrap_err();
    assert!(
        err.to_string().starts_with("cluster.secret: required"),
        "{err}"
    );
    // A variable alone asks for a cluster: the section is made and the rest demanded.
    let err = load_env(&[("DELAYD_CLUSTER_NODE_ID", "1")]).unwrap_err();
    assert!(
        err.to_string().starts_with("cluster.listen: required"),
        "{err}"
    );
    let err = load_env(&[
        ("DELAYD_CLUSTER_SECRET", "0123456789abcdef"),
        ("DELAYD_CLUSTER_NODE_ID", "1"),
        ("DELAYD_CLUSTER_LISTEN", "0.0.0.0:7171"),
    ])
    .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("cluster.members: at least one member"),
        "{err}"
    );
    for (var, value) in [
        ("DELAYD_CLUSTER_NODE_ID", "one"),
        ("DELAYD_CLUSTER_NODE_ID", "-1"),
        ("DELAYD_CLUSTER_ELECTION_TIMEOUT", "1000"),
    ] {
        let err = load_env(&[(var, value)]).unwrap_err();
        assert!(err.to_string().starts_with(var), "{var}={value}: {err}");
    }
    let err = load_env(&[("DELAYD_CLUSTER_MEMBERS", "1")]).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("DELAYD_CLUSTER_MEMBERS: not a delayd setting"),
        "{err}"
    );
}
