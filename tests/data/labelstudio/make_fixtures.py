"""Regenerate the Label Studio export fixtures in this folder.

Drives a local Label Studio server the way its web UI does (session login + CSRF, the same
annotation POST bodies the editor sends) and saves the server's real export output unchanged.
Usage (see README.md): python make_fixtures.py OUT_DIR   -- needs `pip install label-studio`
and a fresh server on http://127.0.0.1:8089 whose first user is alice@example.com/alicepass123.
"""
import datetime, json, os, random, re, string, sys, time
import requests, yaml
import label_studio

BASE = "http://127.0.0.1:8089"
TPL = os.path.join(os.path.dirname(label_studio.__file__), "annotation_templates", "generative-ai")
OUT = sys.argv[1]

def session_for(email, password, signup=False):
    s = requests.Session()
    page = "/user/signup/" if signup else "/user/login/"
    s.get(BASE + page)
    data = {"email": email, "password": password, "csrfmiddlewaretoken": s.cookies["csrftoken"]}
    if signup:
        data["how_find_us"] = "Other"; data["elaborate"] = "fixture"
    r = s.post(BASE + page, data=data, headers={"Referer": BASE + page}, allow_redirects=False)
    assert r.status_code in (302, 303), (page, r.status_code, r.text[:500])
    s.headers["X-CSRFToken"] = s.cookies["csrftoken"]
    s.headers["Referer"] = BASE + "/"
    who = s.get(BASE + "/api/current-user/whoami").json()
    print("logged in", who["id"], who["email"])
    return s

def ok(r):
    if r.status_code >= 400:
        raise SystemExit(f"{r.request.method} {r.url} -> {r.status_code} {r.text[:800]}")
    return r

def nanoid(n=10):
    alphabet = string.ascii_letters + string.digits + "_-"
    return "".join(random.choice(alphabet) for _ in range(n))

def submit(s, task_id, result, lead_time, cancelled=False):
    started = (datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=lead_time))
    body = {"lead_time": lead_time, "result": result, "draft_id": 0,
            "parent_prediction": None, "parent_annotation": None,
            "started_at": started.isoformat(timespec="milliseconds").replace("+00:00", "Z")}
    if cancelled:
        body["was_cancelled"] = True
    r = ok(s.post(f"{BASE}/api/tasks/{task_id}/annotations/?project={s.project}", json=body))
    return r.json()

def ranker_result(buckets):
    # key order as the editor builds it: "_" column first, then Buckets in config order
    return [{"value": {"ranker": buckets}, "id": nanoid(), "from_name": "rank",
             "to_name": "answers", "type": "ranker", "origin": "manual"}]

def pairwise_result(side):
    return [{"value": {"selected": side}, "id": nanoid(), "from_name": "comparison",
             "to_name": "comparison", "type": "pairwise", "origin": "manual"}]

alice = session_for("alice@example.com", "alicepass123")
bob = session_for("bob@example.com", "bobpass12345", signup=True)

# ---------------- LLM Ranker ----------------
cfg = yaml.safe_load(open(os.path.join(TPL, "llm-ranker", "config.yml")))
ranker_xml = cfg["config"]
example = json.loads(re.search(r"<!--(.*)-->", ranker_xml, re.S).group(1))["data"]
open(os.path.join(OUT, "llm_ranker_config.xml"), "w").write(ranker_xml)
items = example["items"]
tasks = [{"task": example["task"], "prompt": example["prompt"], "items": items[i:i + 3]} for i in (0, 3, 6)]
p = ok(alice.post(BASE + "/api/projects", json={"title": "LLM Ranker", "label_config": ranker_xml})).json()
pid = p["id"]; alice.project = bob.project = pid
ok(alice.post(f"{BASE}/api/projects/{pid}/import", files={"file": ("llm_ranker_tasks.json", json.dumps(tasks), "application/json")}))
tids = [t["id"] for t in ok(alice.get(f"{BASE}/api/tasks?project={pid}")).json()["tasks"]]
tids.sort(); print("ranker tasks", tids)
# task 1: alice sorts everything into buckets; bob leaves one item in the unsorted "_" column
submit(alice, tids[0], ranker_result({"_": [], "relevant_results": ["llama_model", "opossum_logic"], "biased_results": ["cobra_ai"]}), 41.532)
submit(bob, tids[0], ranker_result({"_": ["opossum_logic"], "relevant_results": ["llama_model"], "biased_results": ["cobra_ai"]}), 27.118)
# task 2: alice sorts; bob skips (cancelled, nothing touched -> empty result)
submit(alice, tids[1], ranker_result({"_": [], "relevant_results": ["turtle_mind", "eagle_algorithm"], "biased_results": ["puma_intelligence"]}), 35.204)
submit(bob, tids[1], [], 6.871, cancelled=True)
# task 3: no annotations
open(os.path.join(OUT, "llm_ranker_export.json"), "wb").write(
    ok(alice.get(f"{BASE}/api/projects/{pid}/export?exportType=JSON")).content)
open(os.path.join(OUT, "llm_ranker_export_min.json"), "wb").write(
    ok(alice.get(f"{BASE}/api/projects/{pid}/export?exportType=JSON_MIN")).content)

# ---------------- Pairwise (Human Preference collection for RLHF) ----------------
cfg = yaml.safe_load(open(os.path.join(TPL, "human-feedback-collection", "config.yml")))
pw_xml = cfg["config"]
example = json.loads(re.search(r"<!--(.*)-->", pw_xml, re.S).group(1))["data"]
open(os.path.join(OUT, "pairwise_config.xml"), "w").write(pw_xml)
tasks = [example,
         {"prompt": "Explain what a hash table is in one sentence.",
          "answer1": "A hash table is a data structure that maps keys to values by hashing each key to an index in an array of buckets.",
          "answer2": "A hash table is a kind of table used in restaurants to serve hashed potatoes."},
         {"prompt": "What is the capital of Australia?",
          "answer1": "Sydney is the capital of Australia.",
          "answer2": "Canberra is the capital of Australia."}]
p = ok(alice.post(BASE + "/api/projects", json={"title": "Human Preference collection for RLHF", "label_config": pw_xml})).json()
pid = p["id"]; alice.project = bob.project = pid
ok(alice.post(f"{BASE}/api/projects/{pid}/import", files={"file": ("pairwise_tasks.json", json.dumps(tasks), "application/json")}))
tids = sorted(t["id"] for t in ok(alice.get(f"{BASE}/api/tasks?project={pid}")).json()["tasks"])
print("pairwise tasks", tids)
submit(alice, tids[0], pairwise_result("left"), 18.402)
submit(bob, tids[0], pairwise_result("right"), 22.957)
submit(alice, tids[1], pairwise_result("left"), 9.316)
submit(bob, tids[1], [], 4.25, cancelled=True)
# third task left unannotated
open(os.path.join(OUT, "pairwise_export.json"), "wb").write(
    ok(alice.get(f"{BASE}/api/projects/{pid}/export?exportType=JSON")).content)
open(os.path.join(OUT, "pairwise_export_min.json"), "wb").write(
    ok(alice.get(f"{BASE}/api/projects/{pid}/export?exportType=JSON_MIN")).content)

# same exports with download_all_tasks=true (the UI Export button does not send it: unannotated tasks are left out)
for proj, name in ((1, "llm_ranker"), (2, "pairwise")):
    open(os.path.join(OUT, f"{name}_export_all_tasks.json"), "wb").write(
        ok(alice.get(f"{BASE}/api/projects/{proj}/export?exportType=JSON&download_all_tasks=true")).content)

# export snapshot (POST /api/projects/{id}/exports) with completed_by expanded to a user object
snap = ok(alice.post(f"{BASE}/api/projects/{pid}/exports", json={
    "title": "completed_by expanded",
    "serialization_options": {"annotations__completed_by": {"only_id": False}}})).json()
for _ in range(30):
    if ok(alice.get(f"{BASE}/api/projects/{pid}/exports/{snap['id']}")).json()["status"] in ("completed", "failed"):
        break
    time.sleep(2)
open(os.path.join(OUT, "pairwise_export_snapshot_completed_by_expanded.json"), "wb").write(
    ok(alice.get(f"{BASE}/api/projects/{pid}/exports/{snap['id']}/download?exportType=JSON")).content)
print("done")
