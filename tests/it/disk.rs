//! A full disk, for real: a small file system mounted by the test (an ext4 image on a loop device, or a
//! tmpfs of that size), filled by the service itself, then given space back. Mounting needs root; without
//! it the tests say so and pass without running.

use super::*;
use common::{get_message, spawn_with_env, wait_for, write_file};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;

/// A small file system for one test, unmounted (and its image deleted) on drop, pass or fail.
struct SmallFs {
    mount_point: tempfile::TempDir,
    /// The directory holding the ext4 image, when it is one.
    _image_dir: Option<tempfile::TempDir>,
    /// A directory outside it, for the config file.
    outside: tempfile::TempDir,
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

impl SmallFs {
    /// Mounts `mib` MiB of ext4 (no blocks reserved for root: root would otherwise write past the free
    /// space statvfs reports), or a tmpfs of that size where loop devices are not available.
    fn mount(mib: u64) -> Result<SmallFs, String> {
        let mount_point = tempfile::tempdir().map_err(|e| e.to_string())?;
        let outside = tempfile::tempdir().map_err(|e| e.to_string())?;
        let target = mount_point.path().to_str().unwrap().to_string();
        let image_dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let image = image_dir.path().join("fs.img");
        let ext4 = std::fs::File::create(&image)
            .and_then(|f| f.set_len(mib * MIB))
            .map_err(|e| e.to_string())
            .and_then(|()| {
                run(
                    "mkfs.ext4",
                    &["-q", "-F", "-m", "0", image.to_str().unwrap()],
                )
            })
            .and_then(|()| run("mount", &["-o", "loop", image.to_str().unwrap(), &target]));
        match ext4 {
            Ok(()) => Ok(SmallFs {
                mount_point,
                _image_dir: Some(image_dir),
                outside,
            }),
            Err(ext4) => {
                let size = format!("size={mib}m");
                run("mount", &["-t", "tmpfs", "-o", &size, "tmpfs", &target])
                    .map_err(|tmpfs| format!("{ext4}; {tmpfs}"))?;
                Ok(SmallFs {
                    mount_point,
                    _image_dir: None,
                    outside,
                })
            }
        }
    }

    /// [`SmallFs::mount`], or None where it cannot be (without root), saying why the test is skipped.
    fn mount_or_skip(mib: u64) -> Option<SmallFs> {
        SmallFs::mount(mib)
            .inspect_err(|why| println!("skipped: cannot mount a small file system ({why})"))
            .ok()
    }

    /// Fills it with the operator's own file `spare`, whose deletion later makes room (enough for the
    /// WAL's next 64 MiB file once the backlog is filed). What is left after the WAL's two
    /// preallocated 64 MiB files (the second is prepared while the node opens, so they must fit) fills
    /// after about 16 of the tests' 512 KiB messages. Measured, not assumed: mkfs keeps a share that
    /// varies. Returns the spare file.
    fn fill_but_for_the_wal(&self) -> PathBuf {
        let room = schedulelog::available_bytes(self.path()).unwrap();
        let spare = self.path().join("spare");
        let wal_files = 128 * MIB;
        assert!(room > wal_files + 96 * MIB, "{room} bytes free");
        ballast(&spare, room - wal_files - 16 * MIB);
        spare
    }

    /// A config file with `text`, outside the small file system.
    fn config_file(&self, text: &str) -> PathBuf {
        write_file(self.outside.path(), "delayd.toml", text)
    }

    fn path(&self) -> &Path {
        self.mount_point.path()
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let target = self.path().to_str().unwrap().to_string();
        if run("umount", &[&target]).is_err() {
            // Something still holds a file open (a panic before a process guard dropped): detach it.
            let _ = run("umount", &["-l", &target]);
        }
    }
}

/// Writes `bytes` of non-zero data to `path` (a file of the operator's that takes space).
fn ballast(path: &Path, bytes: u64) {
    let chunk = vec![0x5a_u8; MIB as usize];
    let mut file = std::fs::File::create(path).unwrap();
    for _ in 0..bytes / MIB {
        std::io::Write::write_all(&mut file, &chunk).unwrap();
    }
    file.sync_all().unwrap();
}

fn post(base: &str, body: &Value) -> Answer {
    request(base, "POST", "/v1/messages", Some(&body.to_string()), None)
}

fn cancel_message(base: &str, id: &str) -> Answer {
    request(base, "DELETE", &format!("/v1/messages/{id}"), None, None)
}

/// Posts `message` again and again, adding each acknowledged id to `acked`, until one is refused
/// (507); returns that answer. Fails on any other answer, and after 1000 acknowledged (`never`: what
/// never happened).
fn post_until_refused(base: &str, message: &Value, acked: &mut Vec<String>, never: &str) -> Answer {
    loop {
        assert!(acked.len() < 1_000, "{never}");
        let answer = post(base, message);
        match answer.status {
            201 => acked.push(answer.json["id"].as_str().unwrap().to_string()),
            507 => return answer,
            other => panic!("answered {other}: {}", answer.json),
        }
    }
}

/// Reads every queue of `topic` from the start until each of the `wanted` ids arrived, for at most
/// two minutes; returns how often each id arrived. (A few messages a pull: they are large.)
fn consume(base: &str, topic: &str, wanted: &[String]) -> BTreeMap<String, u32> {
    let done = |seen: &BTreeMap<String, u32>| wanted.iter().all(|id| seen.contains_key(id));
    let mut seen = BTreeMap::new();
    let mut offsets = [0u64; 4];
    let pull = |seen: &mut BTreeMap<String, u32>, queue: usize, offset: &mut u64| {
        pull_counting(base, topic, queue, offset, "max=8&wait_ms=100", seen);
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while !done(&seen) && Instant::now() < deadline {
        for (queue, offset) in offsets.iter_mut().enumerate() {
            pull(&mut seen, queue, offset);
        }
    }
    // Then to the end of every queue: a copy stored after the last one wanted counts too.
    let info = request(base, "GET", &format!("/v1/topics/{topic}"), None, None);
    for (queue, offset) in offsets.iter_mut().enumerate() {
        let end = info.json["queues"][queue]["max_offset"]
            .as_u64()
            .unwrap_or(0);
        while *offset < end {
            pull(&mut seen, queue, offset);
        }
    }
    seen
}

/// The reserve off, so that the service fills the disk to the last block: the replayer and the broker
/// meet ENOSPC, the WAL cannot start its next file. Nothing is lost, nothing poisons; once the operator
/// deletes a file, the node heals without a restart and delivers every acknowledged message once.
#[test]
fn a_disk_filled_to_the_last_block_refuses_then_heals_without_a_restart() {
    let Some(fs) = SmallFs::mount_or_skip(320) else {
        return;
    };
    let spare = fs.fill_but_for_the_wal();
    let config = fs.config_file("[broker]\nsegment_bytes = 1048576\n");
    let process = spawn(
        &fs.path().join("data"),
        &["--config", config.to_str().unwrap()],
    );
    let base = process.base.clone();
    // A message due in an hour, to cancel while the disk is full.
    let later = post(
        &base,
        &json!({"topic": "full", "body": "cancel me", "delay": "1h"}),
    );
    assert_eq!(later.status, 201, "{}", later.json);
    let later = later.json["id"].as_str().unwrap().to_string();

    // 512 KiB messages due at once: the schedule segment and the broker each take a copy.
    let body = "f".repeat(512 << 10);
    let mut acked = Vec::new();
    let message = json!({"topic": "full", "body": body, "delay": 0});
    let refused = post_until_refused(&base, &message, &mut acked, "the disk never filled");
    assert_eq!(refused.json["code"], "disk_full");
    assert_eq!(refused.content_type, "application/problem+json");
    println!("{} messages acknowledged before the first 507", acked.len());

    // The node says why, in /readyz, the metric and its log (once, with the file and the OS error).
    wait_for(
        "/readyz to report the full disk",
        Duration::from_secs(30),
        || {
            let ready = request(&base, "GET", "/readyz", None, None);
            ready.json["disk_full"]
                .as_str()
                .is_some_and(|why| why.contains("No space left on device"))
        },
    );
    // Still ready: it delivers, cancels and serves pulls; only new messages wait.
    let ready = request(&base, "GET", "/readyz", None, None);
    assert_eq!(ready.status, 200);
    let detail = ready.json["disk_full"].as_str().unwrap().to_string();
    assert!(detail.contains("No space left on device"), "{detail}");
    assert_eq!(scrape(&base).get("delayd_disk_full"), Some(&1.0));
    // A full disk is not a storage failure: nothing needs a restart.
    assert_eq!(scrape(&base).get("delayd_storage_failed"), Some(&0.0));
    wait_for("the log to name the cause", Duration::from_secs(30), || {
        process.output_tail(200).contains("No space left on device")
    });
    let log = process.output_tail(200);
    assert!(log.contains("disk full"), "{log}");
    assert!(!log.contains("poisoned"), "{log}");
    println!("{detail}\n{log}");
    // Still refusing, never poisoned.
    let again = post(&base, &json!({"topic": "full", "body": body, "delay": 0}));
    assert_eq!(again.status, 507, "{}", again.json);
    // A cancel needs only a few bytes of the WAL: it works now or once space is back.
    let cancel = cancel_message(&base, &later);
    assert!([200, 507].contains(&cancel.status), "{}", cancel.json);

    // The operator frees space: writes resume, without a restart.
    std::fs::remove_file(&spare).unwrap();
    let pid = process.pid();
    wait_for(
        "a message to be accepted again",
        Duration::from_secs(60),
        || {
            let answer = post(
                &base,
                &json!({"topic": "full", "body": "after", "delay": 0}),
            );
            if answer.status == 201 {
                acked.push(answer.json["id"].as_str().unwrap().to_string());
            }
            answer.status == 201
        },
    );
    assert_eq!(process.pid(), pid);
    if cancel.status != 200 {
        let cancel = cancel_message(&base, &later);
        assert_eq!(cancel.status, 200, "{}", cancel.json);
    }

    // Every acknowledged message is delivered exactly once; the cancelled one never.
    let seen = consume(&base, "full", &acked);
    let missing: Vec<&String> = acked.iter().filter(|id| !seen.contains_key(*id)).collect();
    assert!(
        missing.is_empty(),
        "{} acknowledged messages never delivered",
        missing.len()
    );
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "delivered more than once: {twice:?}");
    assert_eq!(
        seen.len(),
        acked.len(),
        "only acknowledged messages were delivered"
    );
    let status = get_message(&base, &later);
    assert_eq!(status.json["status"], "cancelled");
    wait_for("/readyz to recover", Duration::from_secs(30), || {
        request(&base, "GET", "/readyz", None, None).json == json!({"status": "ready"})
    });
    assert_eq!(scrape(&base).get("delayd_disk_full"), Some(&0.0));
    drop(process);
}

/// The reserve on: new messages are refused while free space is below it, while what was accepted is
/// delivered all the same (into the reserve) and cancels still go through. Once the operator frees space,
/// new messages are accepted again, on their own.
#[test]
fn below_the_reserve_new_messages_wait_while_deliveries_and_cancels_go_on() {
    let Some(fs) = SmallFs::mount_or_skip(384) else {
        return;
    };
    let spare = fs.path().join("spare");
    ballast(&spare, 48 * MIB);
    let config = fs.config_file("[broker]\nsegment_bytes = 1048576\n");
    let reserve = (128 * MIB).to_string();
    let process = spawn_with_env(
        &fs.path().join("data"),
        &["--config", config.to_str().unwrap()],
        &[("DELAYD_MIN_FREE_DISK_BYTES", &reserve)],
    );
    let base = process.base.clone();
    // The WAL zero-fills its next file in the background after a start: a steady state to measure the
    // free space from.
    let next = fs.path().join("data/wal/next.tmp");
    wait_for("the WAL's next file", Duration::from_secs(30), || {
        std::fs::metadata(&next).is_ok_and(|m| m.len() == 64 * MIB)
    });
    let later = post(
        &base,
        &json!({"topic": "reserve", "body": "cancel me", "delay": "1h"}),
    );
    assert_eq!(later.status, 201, "{}", later.json);
    let later = later.json["id"].as_str().unwrap().to_string();
    // All due at one moment a few seconds ahead: normally after the reserve is reached (the filling
    // takes a second or two), so that they are delivered while new messages are refused.
    let due = now_ms() + 6_000;
    let body = "r".repeat(512 << 10);
    let mut acked = Vec::new();
    // A few first, then a check of the free space that counts their schedule copies: their broker
    // copies, written at `due`, come out of what that check left for new messages, so that the
    // deliveries take the free space below the reserve (a fill within one check period would leave
    // it within a message of the reserve, either side).
    let free = || {
        scrape(&base)
            .get("delayd_disk_free_bytes")
            .copied()
            .unwrap_or(0.0)
    };
    let before = free();
    for _ in 0..4 {
        let answer = post(
            &base,
            &json!({"topic": "reserve", "body": body, "deliver_at": due}),
        );
        assert_eq!(answer.status, 201, "{}", answer.json);
        acked.push(answer.json["id"].as_str().unwrap().to_string());
    }
    wait_for(
        "a check of the free space that counts them",
        Duration::from_secs(10),
        || free() <= before - f64::from(4 * (512 << 10)),
    );
    let message = json!({"topic": "reserve", "body": body, "deliver_at": due});
    let refused = post_until_refused(&base, &message, &mut acked, "the reserve was never reached");
    let refused_at = now_ms();
    assert_eq!(refused.json["code"], "disk_full");
    // Refused in time: by the reserve, not by a write that found no space (a burst cannot run through
    // it between two checks of the free space).
    let why = refused.json["detail"].as_str().unwrap();
    assert!(why.contains("nearly full"), "{why}");
    if refused_at < due {
        // The budget counts each message twice (its broker copy too): the free space sinks below the
        // reserve as the deliveries are written, at `due`. (On a busy machine the filling may outlast
        // `due`: then each check saw the broker copies already written, and the free space may end
        // just above the reserve.)
        let deadline = Instant::now() + Duration::from_secs(40);
        while !request(&base, "GET", "/readyz", None, None).json["disk_full"]
            .as_str()
            .is_some_and(|why| why.contains("min_free_disk_bytes"))
        {
            let metrics = scrape(&base);
            assert!(
                Instant::now() < deadline,
                "/readyz never named the reserve: free {:?}, {} acked, refused {} ms before due, {:?} delivered",
                metrics.get("delayd_disk_free_bytes"),
                acked.len(),
                due - refused_at,
                metrics.get(r#"delayd_messages_delivered_total{sink="broker",outcome="ok"}"#),
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let ready = request(&base, "GET", "/readyz", None, None);
    assert_eq!(ready.status, 200);
    assert!(
        !ready.json["disk_full"]
            .as_str()
            .unwrap_or_default()
            .contains("No space left"),
        "{}",
        ready.json
    );
    // A cancel takes a few bytes of the WAL: it goes through while new messages are refused.
    let cancel = cancel_message(&base, &later);
    assert_eq!(cancel.status, 200, "{}", cancel.json);
    // What was accepted is delivered all the same, into the reserve.
    let seen = consume(&base, "reserve", &acked);
    assert!(
        acked.iter().all(|id| seen.get(id) == Some(&1)),
        "each acknowledged message once"
    );
    if refused_at < due {
        // Delivered while refusing: the deliveries used the reserve, they did not end the refusal.
        let still = post(&base, &json!({"topic": "reserve", "body": "x", "delay": 0}));
        assert_eq!(still.status, 507, "{}", still.json);
    }
    // The operator makes room: accepted again, without a restart.
    std::fs::remove_file(&spare).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while post(
        &base,
        &json!({"topic": "reserve", "body": "after", "delay": 0}),
    )
    .status
        != 201
    {
        let ready = request(&base, "GET", "/readyz", None, None);
        assert!(
            Instant::now() < deadline,
            "never accepted again: {}; {:?}",
            ready.json,
            std::fs::read_dir(fs.path().join("data/wal"))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_for("/readyz to recover", Duration::from_secs(30), || {
        request(&base, "GET", "/readyz", None, None).json == json!({"status": "ready"})
    });
    let status = get_message(&base, &later);
    assert_eq!(status.json["status"], "cancelled");
    drop(process);
}

/// A node stopped (kill -9) with its disk full starts on it all the same, with an MQ source: it
/// answers, refuses new and keyed messages (507) while there is no room, its source says what it waits
/// for, and everything heals without a restart once the operator makes room. (A source used to read the
/// log back at the start and fail the whole start while the replayer waited for space.)
#[test]
fn a_node_with_a_source_starts_on_a_full_disk_and_heals() {
    let Some(fs) = SmallFs::mount_or_skip(320) else {
        return;
    };
    let spare = fs.fill_but_for_the_wal();
    // The source's MQ is not there (a closed port): what matters here is its start.
    let closed = common::free_port();
    let config = fs.config_file(&format!(
        "[broker]\nsegment_bytes = 1048576\n\n\
             [sinks.out]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:{closed}/\"\n\n\
             [sources.in]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:{closed}/\"\n\
             stream_key = \"in\"\nconsumer = \"node-1\"\nsink = \"out\"\n"
    ));
    let data = fs.path().join("data");
    let args = ["--config", config.to_str().unwrap()];
    let mut process = spawn(&data, &args);
    // Due in an hour: they stay in their schedule segment, which the disk cannot hold.
    let body = "f".repeat(512 << 10);
    let mut acked = Vec::new();
    let message = json!({"topic": "full", "body": body, "delay": "1h"});
    post_until_refused(&process.base, &message, &mut acked, "the disk never filled");
    process.kill();
    let process = spawn(&data, &args);
    let base = process.base.clone();
    let keyed = json!({"topic": "full", "body": "k", "delay": "1h", "key": "k-1", "dedup": true});
    assert_eq!(post(&base, &keyed).status, 507);
    // The source starts beside the API: it says so once its start reached the disk.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let sources = request(&base, "GET", "/v1/sources", None, None);
        let waits = sources.json["sources"][0]["last_error"]
            .as_str()
            .map(str::to_owned);
        if waits.is_some_and(|e| e.contains("waiting for the disk") && e.contains("No space left"))
        {
            break;
        }
        assert!(Instant::now() < deadline, "{}", sources.json);
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::remove_file(&spare).unwrap();
    wait_for(
        "a keyed message to be accepted",
        Duration::from_secs(60),
        || post(&base, &keyed).status == 201,
    );
    // Accepted once: the index of keys holds it.
    let again = post(&base, &keyed);
    assert_eq!(again.status, 200, "{}", again.json);
    wait_for(
        "the source to have read back what it wrote and be connecting",
        Duration::from_secs(30),
        || {
            let sources = request(&base, "GET", "/v1/sources", None, None);
            sources.json["sources"][0]["last_error"]
                .as_str()
                .is_some_and(|e| !e.contains("waiting for the disk"))
        },
    );
    for id in &acked {
        let status = get_message(&base, id);
        assert_eq!(status.json["status"], "scheduled", "{}", status.json);
    }
}
