//! The console (`GET /ui`) in a real browser: headless Chromium from Debian driven over WebDriver
//! (chromedriver on a free port, spoken to with the tests' own HTTP client), against the service with
//! messages pending, delivered and dead, recurring schedules, a bearer token, and a webhook receiver
//! that makes dead letters.
//! A screenshot is saved as `target/console.png`.

use super::webhook::{endpoint, webhook_sink};
use super::*;
use base64::Engine;
use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::{Child, Stdio};

const TOKEN: &str = "console-test-token";
const HOUR_MS: i64 = 3_600_000;

/// chromedriver and the browser it started; both are ended on drop, pass or fail.
struct Browser {
    driver: Child,
    base: String,
    session: String,
    _profile: tempfile::TempDir,
}

impl Browser {
    fn start() -> Option<Browser> {
        if !common::server_installed(
            "chromedriver",
            "apt-get install -y chromium chromium-driver",
        ) {
            return None;
        }
        let port = common::free_port();
        let profile = tempfile::Builder::new()
            .prefix("delayd-console-test-")
            .tempdir()
            .unwrap();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Its own process group: the browser it starts is ended with it.
            .process_group(0)
            .spawn()
            .unwrap();
        let mut browser = Browser {
            driver,
            base: format!("http://127.0.0.1:{port}"),
            session: String::new(),
            _profile: profile,
        };
        common::wait_for("chromedriver answers", Duration::from_secs(30), || {
            common::agent(Duration::from_secs(2))
                .get(&format!("{}/status", browser.base))
                .call()
                .is_ok_and(|r| r.status() == 200)
        });
        let profile = browser._profile.path().to_str().unwrap().to_string();
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1280,1700", format!("--user-data-dir={profile}")],
            },
        }}});
        let answer = browser.call("POST", "/session", Some(capabilities));
        browser.session = answer["sessionId"].as_str().expect("a session").to_string();
        Some(browser)
    }

    /// A WebDriver command; its `value`. Panics on a WebDriver error.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let answer = request(
            &self.base,
            method,
            path,
            body.map(|b| b.to_string()).as_deref(),
            None,
        );
        assert_eq!(answer.status, 200, "{method} {path}: {}", answer.json);
        answer.json["value"].clone()
    }

    fn session(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.call(method, &format!("/session/{}{path}", self.session), body)
    }

    /// Runs a script in the page and returns its value.
    fn script(&self, script: &str) -> Value {
        self.session(
            "POST",
            "/execute/sync",
            Some(json!({"script": script, "args": []})),
        )
    }

    /// Waits until a script returns something other than null or false; returns that.
    fn wait(&self, what: &str, script: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let value = self.script(script);
            if !value.is_null() && value != json!(false) {
                return value;
            }
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The WebDriver id of the element `css` selects.
    fn element(&self, css: &str) -> String {
        let found = self.session(
            "POST",
            "/element",
            Some(json!({"using": "css selector", "value": css})),
        );
        found
            .as_object()
            .and_then(|o| o.values().next())
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("no element {css}: {found}"))
            .to_string()
    }

    /// Clicks the element `css` selects; found again if the page redrew it in between (the console
    /// redraws a table when its data changes).
    fn click(&self, css: &str) {
        for _ in 0..5 {
            let element = self.element(css);
            let path = format!("/session/{}/element/{element}/click", self.session);
            let answer = request(&self.base, "POST", &path, Some("{}"), None);
            if answer.status == 200 {
                return;
            }
            let stale = answer.json["value"]["error"] == "stale element reference";
            assert!(stale, "click {css}: {}", answer.json);
        }
        panic!("{css} was redrawn under every click");
    }

    fn type_into(&self, css: &str, text: &str) {
        let element = self.element(css);
        self.session(
            "POST",
            &format!("/element/{element}/clear"),
            Some(json!({})),
        );
        self.session(
            "POST",
            &format!("/element/{element}/value"),
            Some(json!({"text": text})),
        );
    }

    fn text(&self, css: &str) -> String {
        let element = self.element(css);
        self.session("GET", &format!("/element/{element}/text"), None)
            .as_str()
            .unwrap()
            .to_string()
    }

    fn screenshot(&self, path: &std::path::Path) {
        let png = self.session("GET", "/screenshot", None);
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().unwrap())
            .unwrap();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            // Closes the browser; errors do not matter, the group is ended next.
            let _ = common::agent(Duration::from_secs(10))
                .delete(&format!("{}/session/{}", self.base, self.session))
                .call();
        }
        let group = format!("-{}", self.driver.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        // A browser process that left the group (Chromium's zygote may) is found by its profile dir.
        let profile = self._profile.path().to_string_lossy().to_string();
        let _ = Command::new("pkill")
            .args(["-KILL", "-f", &profile])
            .status();
    }
}

/// Where cargo puts build output: the screenshot goes there.
fn target_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target"))
}

#[test]
fn the_console_shows_pending_hours_requeues_dead_letters_looks_up_ids_and_pauses_schedules() {
    let Some(browser) = Browser::start() else {
        return;
    };
    let hook = endpoint(&[("doomed", vec!["400", "ok"]), ("lost", vec!["400"])]);
    let server = Server::start(|c| {
        c.auth.tokens = vec![TOKEN.into()];
        c.sinks
            .insert("hooks".into(), webhook_sink(&hook.url, |_, _| {}));
    });
    let call = |method: &str, path: &str, body: Option<Value>| {
        request(
            &server.base,
            method,
            path,
            body.map(|b| b.to_string()).as_deref(),
            Some(TOKEN),
        )
    };
    // Pending: 3 due in two hours' time, 1 in five, 2 three days away (past the 48-hour chart).
    let hour = now_ms() / HOUR_MS * HOUR_MS;
    let due = [2, 2, 2, 5, 72, 73].map(|h| hour + h * HOUR_MS + 60_000);
    let messages: Vec<Value> = due
        .iter()
        .map(|at| json!({"topic": "orders", "body": "later", "deliver_at": at}))
        .collect();
    let answer = call(
        "POST",
        "/v1/messages/batch",
        Some(json!({"messages": messages})),
    );
    assert_eq!(answer.status, 200, "{}", answer.json);
    // Delivered (into the broker), and two dead letters.
    let answer = call(
        "POST",
        "/v1/messages",
        Some(json!({"topic": "orders", "body": "now", "delay": 0})),
    );
    assert_eq!(answer.status, 201, "{}", answer.json);
    let delivered = answer.json["id"].as_str().unwrap().to_string();
    let doomed = schedule_with_token(&server, json!({"body": "doomed"}));
    let lost = schedule_with_token(&server, json!({"body": "lost"}));
    for id in [&doomed, &lost] {
        wait_for_status(&server, id, "dead");
    }
    wait_for_status(&server, &delivered, "delivered");

    // Without a token, the page asks for one; a wrong one is refused.
    browser.session(
        "POST",
        "/url",
        Some(json!({"url": format!("{}/ui", server.base)})),
    );
    browser.wait(
        "the login prompt shows",
        "return !document.getElementById('login').hidden",
    );
    browser.type_into("#token", "wrong");
    browser.click("#login-submit");
    browser.wait(
        "the wrong token is refused",
        "return document.getElementById('login-message').textContent.includes('refused')",
    );
    browser.type_into("#token", TOKEN);
    browser.click("#login-submit");
    browser.wait(
        "the dashboard shows",
        "return document.getElementById('login').hidden && !document.getElementById('dashboard').hidden",
    );
    browser.wait(
        "the schedules panel says there are none",
        "return !document.getElementById('schedules-empty').hidden",
    );

    // One bar per pending hour of the next 48, as high as its count; the rest per day beyond.
    let mut hours: BTreeMap<String, u64> = BTreeMap::new();
    for at in due.iter().filter(|at| **at < hour + 48 * HOUR_MS) {
        *hours
            .entry(delayd::timestamp::format_ms(at / HOUR_MS * HOUR_MS))
            .or_default() += 1;
    }
    let bars = browser.wait(
        "the hourly bars are drawn",
        "const bars = [...document.querySelectorAll('#timeline rect.bar')];
         return bars.length ? bars.map(b => [b.dataset.start, Number(b.dataset.pending), b.getBBox().height]) : null",
    );
    let drawn: BTreeMap<String, u64> = bars
        .as_array()
        .unwrap()
        .iter()
        .map(|b| (b[0].as_str().unwrap().to_string(), b[1].as_u64().unwrap()))
        .collect();
    // (The page shows whole seconds; the API's times carry milliseconds.)
    let drawn: BTreeMap<String, u64> = drawn
        .into_iter()
        .map(|(start, n)| (start.replace(".000Z", "Z"), n))
        .collect();
    let hours: BTreeMap<String, u64> = hours
        .into_iter()
        .map(|(start, n)| (start.replace(".000Z", "Z"), n))
        .collect();
    assert_eq!(drawn, hours, "{bars}");
    let heights: Vec<f64> = bars
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b[2].as_f64().unwrap())
        .collect();
    let (tallest, shortest) = (
        heights.iter().cloned().fold(0.0, f64::max),
        heights.iter().cloned().fold(f64::MAX, f64::min),
    );
    assert!(
        (tallest / shortest - 3.0).abs() < 0.05,
        "heights {heights:?}: 3 against 1"
    );
    let days = browser.wait(
        "the daily bars are drawn",
        "const bars = [...document.querySelectorAll('#beyond rect.bar-day')];
         return bars.length ? bars.map(b => Number(b.dataset.pending)).reduce((a, b) => a + b, 0) : null",
    );
    assert_eq!(days, 2);

    // The sinks say what they are: the broker is built in, a webhook has no connection to show.
    let states = browser.wait(
        "the sinks are listed",
        "const rows = [...document.querySelectorAll('#sinks tbody tr')];
         return rows.length == 2 ? rows.map(r => [r.dataset.name, r.querySelector('td.state').textContent]) : null",
    );
    assert_eq!(
        states,
        json!([["broker", "built-in"], ["hooks", "per request"]])
    );

    // The dead letters, each with its buttons; requeue one from the page.
    let doomed_row = format!("tr.dead-row[data-id='{doomed}']");
    browser.wait(
        "both dead letters are listed",
        &format!(
            "return document.querySelectorAll(\"tr.dead-row[data-id='{doomed}'], tr.dead-row[data-id='{lost}']\").length == 2"
        ),
    );
    browser.click(&format!("{doomed_row} button.requeue"));
    browser.wait(
        "the page says it requeued",
        "return document.getElementById('notice').textContent.includes('Requeued')",
    );
    assert_eq!(hook.wait_for("doomed", 2).len(), 2, "delivered again");
    wait_for_status(&server, &doomed, "delivered");
    browser.wait(
        "the requeued one leaves the list",
        &format!("return !document.querySelector(\"{doomed_row}\")"),
    );

    // Lookups: a known id shows its status; an unknown one says so.
    browser.type_into("#lookup-id", &delivered);
    browser.click("#lookup-submit");
    browser.wait(
        "the lookup shows the status",
        "const s = document.getElementById('lookup-status'); return s && s.textContent == 'delivered'",
    );
    browser.type_into("#lookup-id", &"a".repeat(23));
    browser.click("#lookup-submit");
    browser.wait(
        "the lookup says there is no such message",
        "return document.getElementById('lookup-result').textContent.includes('No message')",
    );
    assert!(browser.text("#lookup-result").contains("No message"));

    // Schedules, put only now (a firing due within a minute is a pending message, which the chart
    // above would count): one on a cron, paused and resumed from the page, and one that fires every
    // second, whose last firing is linked.
    let put = call(
        "PUT",
        "/v1/schedules/reports.daily",
        Some(
            json!({"cron": "0 9 * * MON-FRI", "tz": "Europe/Berlin", "topic": "reports.daily",
                    "body": "report"}),
        ),
    );
    assert_eq!(put.status, 201, "{}", put.json);
    let next = put.json["next_fire_at"].clone();
    let put = call(
        "PUT",
        "/v1/schedules/console.tick",
        Some(json!({"every": "1s", "topic": "ticks", "body": "tick"})),
    );
    assert_eq!(put.status, 201, "{}", put.json);
    let row = "tr.schedule-row[data-id='reports.daily']";
    // The row's paused flag, cells, and next firing (null when none is shown), once `condition` (on
    // `cells`) holds.
    let cells = |condition: &str| {
        format!(
            "const r = document.querySelector(\"{row}\");
             const cells = r && [r.dataset.paused,
                 ...['timing', 'tz', 'paused', 'fired'].map(c => r.querySelector('td.' + c).textContent),
                 r.querySelector('td.next-fire time')?.getAttribute('datetime') ?? null];
             return cells && ({condition}) && cells"
        )
    };
    let shown = browser.wait("the schedule is listed", &cells("true"));
    assert_eq!(
        shown,
        json!(["false", "0 9 * * MON-FRI", "Europe/Berlin", "no", "0", next])
    );
    browser.click(&format!("{row} button.pause"));
    let paused = browser.wait(
        "the row shows the schedule paused",
        &cells("cells[0] == 'true'"),
    );
    assert_eq!(
        paused,
        json!(["true", "0 9 * * MON-FRI", "Europe/Berlin", "yes", "0", null])
    );
    assert!(browser.text("#notice").contains("Paused reports.daily"));
    let got = call("GET", "/v1/schedules/reports.daily", None);
    assert_eq!(
        (&got.json["paused"], &got.json["next_fire_at"]),
        (&json!(true), &Value::Null)
    );
    browser.click(&format!("{row} button.resume"));
    let resumed = browser.wait(
        "the row shows the schedule resumed",
        &cells("cells[0] == 'false'"),
    );
    let got = call("GET", "/v1/schedules/reports.daily", None);
    assert_eq!(got.json["paused"], false);
    assert_eq!(resumed[3], "no");
    assert_eq!(resumed[5], got.json["next_fire_at"]);

    let tick_link = "tr.schedule-row[data-id='console.tick'] td.last-fire a.id-link";
    browser.wait(
        "the ticking schedule links its last firing",
        &format!("return document.querySelector(\"{tick_link}\")"),
    );
    browser.click(tick_link);
    let looked_up = browser.wait(
        "the lookup shows the firing",
        "const s = document.getElementById('lookup-status');
         return s && document.getElementById('lookup-result').textContent.includes('ticks') && s.textContent",
    );
    assert!(
        ["scheduled", "delivered"].contains(&looked_up.as_str().unwrap()),
        "{looked_up}"
    );

    // Fifty more, and the ticking one deleted: two pages, Next and Previous between them.
    assert_eq!(
        call("DELETE", "/v1/schedules/console.tick", None).status,
        200
    );
    for i in 0..50 {
        let put = call(
            "PUT",
            &format!("/v1/schedules/page.{i:02}"),
            Some(json!({"cron": "@yearly", "topic": "pages", "body": "x"})),
        );
        assert_eq!(put.status, 201, "{}", put.json);
    }
    let ids = "const rows = [...document.querySelectorAll('#schedules tbody tr')].map(r => r.dataset.id);";
    browser.wait(
        "the first page is full, without the deleted schedule",
        &format!("{ids} return rows.length == 50 && rows[0] == 'page.00' && rows[49] == 'page.49'"),
    );
    browser.click("#schedules-next");
    browser.wait(
        "the second page shows the rest",
        &format!("{ids} return rows.length == 1 && rows[0] == 'reports.daily'"),
    );
    browser.click("#schedules-prev");
    browser.wait(
        "the first page shows again",
        &format!("{ids} return rows.length == 50 && rows[0] == 'page.00'"),
    );

    browser.script("window.scrollTo(0, 0); return null");
    let shot = target_dir().join("console.png");
    browser.screenshot(&shot);
    println!("screenshot: {}", shot.display());
    assert!(std::fs::metadata(&shot).unwrap().len() > 10_000);
}

fn schedule_with_token(server: &Server, body: Value) -> String {
    let mut message = json!({"topic": "hooks.test", "delay": 0, "sink": "hooks"});
    for (k, v) in body.as_object().unwrap() {
        message[k] = v.clone();
    }
    let answer = request(
        &server.base,
        "POST",
        "/v1/messages",
        Some(&message.to_string()),
        Some(TOKEN),
    );
    assert_eq!(answer.status, 201, "{}", answer.json);
    answer.json["id"].as_str().unwrap().to_string()
}

/// Polls the status API until the message reaches `status` (30 s at most).
fn wait_for_status(server: &Server, id: &str, status: &str) {
    common::wait_for(
        &format!("{id} is {status}"),
        Duration::from_secs(30),
        || {
            let answer = request(
                &server.base,
                "GET",
                &format!("/v1/messages/{id}"),
                None,
                Some(TOKEN),
            );
            answer.json["status"] == status
        },
    );
}
