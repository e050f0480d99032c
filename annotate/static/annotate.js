// Ranking by click and keyboard, entirely in the page: no server round trip per pick.
//
// The item HTML (annotate/render.py) carries data-token (one showing of one item) and data-k; each
// card its display position (data-pos) and the key that ranks it (data-key: 1-9, then letters the
// other shortcuts leave free, shown on the card). Picks are kept here as tie groups of 1-based
// display positions, best first, e.g. [[2],[1,3],[4]], and sent with Submit as "2>1=3>4" (the
// Submit event's `js` hook calls rlhf.encode), with the strength of the best over the second
// (key 0 steps through it). A new token in the page (next item, undo) resets the ranking.
// The annotator's own answer (#rl-edit-text, started from a card's verbatim text by its ✎ Edit or
// by E) is ranked as one more card, position K+1, shown as ✎; Submit sends it with the position
// of the response it was written from. Shortcuts are ignored while typing in a field.
//
// Two panels share this code: the Annotate tab's (window.rlhf, elements #rl-item, #rl-rankbar, ...)
// and the Chat tab's (window.rlhfChat, the same elements named #rl-chat-item, #rl-chat-rankbar, ...:
// annotate/ui_chat.py). Each keeps its own ranking; clicks and keys go to the panel on screen.
(() => {
  if (window.rlhf) return;
  // How much better the best response is than the second (store/records.py STRENGTHS), set with 0.
  const STRENGTHS = ["much better", "better", "slightly better", "about the same"];
  const visible = (el) => !!el && el.offsetParent !== null;

  // One panel: its elements' ids start with `prefix` where the Annotate tab's start with "rl".
  function makePanel(prefix) {
    const R = { token: null, el: null, groups: [], tieNext: false, strength: "", editFrom: 0, prefix };
    const sel = (s) => s.replaceAll("#rl-", `#${prefix}-`);
    const $ = (s) => document.querySelector(sel(s));
    const item = () => $("#rl-item .rl-item");
    R.item = item;
    const k = () => {
      const it = item();
      return it ? parseInt(it.dataset.k || "0", 10) : 0;
    };
    const editBox = () => $("#rl-edit-text");
    const hasEdit = () => !!editBox() && editBox().value.trim() !== "" && R.editFrom > 0;
    const n = () => k() + (hasEdit() ? 1 : 0); // what can be ranked: the cards, and the own answer
    R.editText = () => (hasEdit() ? editBox().value : "");
    const ranked = () => R.groups.flat();
    // The key shown on the card at a position, and the position a key ranks (0: none).
    const keyOf = (pos) => {
      if (pos === k() + 1) return "✎";
      const card = $(`#rl-item .rl-card[data-pos="${pos}"]`);
      return card ? (card.dataset.key || String(pos)).toUpperCase() : String(pos);
    };
    const posOf = (key) => {
      const card = key && $(`#rl-item .rl-card[data-key="${key}"]`);
      return card ? parseInt(card.dataset.pos, 10) : 0;
    };
    const keysHint = (n) => (n <= 9 ? `1–${n}` : `1–9, then ${[10, 11, 12].filter((p) => p <= n).map(keyOf).join(", ")}${n > 12 ? " …" : ""}`);
    const click = (s) => {
      const el = $(s);
      if (el && !el.disabled) el.click();
    };

    // Reset when the server shows a different item; repaint either way.
    function sync() {
      const it = item();
      const tok = it ? it.dataset.token : null;
      if (tok !== R.token) {
        R.token = tok;
        R.groups = [];
        R.tieNext = false;
        R.strength = "";
        R.editFrom = 0;
        if (editBox()) editBox().value = "";
      }
      paint();
    }

    // Start the own answer from the verbatim text of the card at `pos` (kept unless already begun
    // from it), and put the cursor in it.
    function startEdit(pos) {
      sync();
      const box = editBox();
      const raw = $(`#rl-item .rl-card[data-pos="${pos}"] .rl-raw`);
      if (!box || !raw) return;
      if (R.editFrom !== pos || !box.value.trim()) box.value = raw.value;
      R.editFrom = pos;
      paint();
      box.focus();
    }
    // E: begin an answer from the best-ranked response (or the first), or once begun, rank it.
    function editKey() {
      sync();
      if (hasEdit()) pick(k() + 1, false);
      else startEdit(ranked()[0] || 1);
    }
    // An emptied answer leaves the ranking.
    function editChanged() {
      if (!hasEdit()) R.groups = R.groups.map((g) => g.filter((p) => p <= k())).filter((g) => g.length);
      paint();
    }

    // The best and second responses stand alone in their ranks (the rest may tie): a strength
    // compares those two. With one response left unranked, it is the second.
    const topPairRanked = () => {
      const g = R.groups;
      if (!g.length || g[0].length !== 1) return false;
      return g.length >= 2 ? g[1].length === 1 : k() - 1 === 1;
    };
    function nextStrength() {
      sync();
      const at = STRENGTHS.indexOf(R.strength);
      R.strength = at === STRENGTHS.length - 1 ? "" : STRENGTHS[at + 1];
      paint();
    }

    function pick(pos, tie) {
      sync();
      if (pos < 1 || pos > n()) return;
      const at = R.groups.findIndex((g) => g.includes(pos));
      if (at >= 0) {
        // Picking a ranked response again takes it out of the ranking.
        R.groups[at] = R.groups[at].filter((p) => p !== pos);
        R.groups = R.groups.filter((g) => g.length);
      } else if (tie && R.groups.length) {
        R.groups[R.groups.length - 1].push(pos);
      } else {
        R.groups.push([pos]);
      }
      R.tieNext = false;
      paint();
    }

    // The Submit event's `js` hook reads these: the ranking as "2>1=3>4" and the token of the
    // showing it belongs to (the server refuses a ranking made for another showing).
    R.encode = () => {
      sync();
      return R.groups.map((g) => g.join("=")).join(">");
    };
    R.currentToken = () => {
      sync();
      return R.token || "";
    };

    function ordinal(n) {
      const s = ["th", "st", "nd", "rd"], v = n % 100;
      return n + (s[(v - 20) % 10] || s[v] || s[0]);
    }

    function paint() {
      const it = item();
      const total = n();
      let rank = 1;
      const rankOf = {};
      R.groups.forEach((g) => {
        g.forEach((p) => (rankOf[p] = { rank, tie: g.length > 1 }));
        rank += g.length;
      });
      if (it) {
        it.querySelectorAll(".rl-card").forEach((card) => {
          const r = rankOf[parseInt(card.dataset.pos, 10)];
          card.classList.toggle("rl-ranked", !!r);
          card.classList.toggle("rl-best", !!r && r.rank === 1);
          card.classList.toggle("rl-tied", !!r && r.tie);
          card.querySelector(".rl-badge").textContent = r ? (r.tie ? "tie " : "") + ordinal(r.rank) : "";
        });
      }
      const from = $("#rl-edit-from");
      const own = rankOf[k() + 1];
      if (from) from.textContent = !hasEdit() ? "Press ✎ Edit on a response (or E) to write a better one from it." :
        `Written from response ${R.editFrom}` + (own ? ` · ranked ${ordinal(own.rank)} (✎)` : ": press E to rank it (✎)");
      const bar = $("#rl-rankbar");
      if (!bar) return;
      if (!total) {
        bar.innerHTML = "";
        return;
      }
      const left = total - ranked().length;
      const chips = R.groups
        .map((g) => g.map((p) => `<span class="rl-chip">${keyOf(p)}</span>`).join('<span class="rl-eq">=</span>'))
        .join('<span class="rl-gt">›</span>');
      const empty = Array.from({ length: left }, () => '<span class="rl-chip rl-chip-empty"></span>').join("");
      let hint;
      if (!R.groups.length) hint = `Press ${keysHint(k())}${hasEdit() ? " and E" : ""} (or click) from best to worst`;
      else if (left === 0) hint = "Ready: press Enter to submit";
      else if (left === 1) hint = "The last one goes last: press Enter to submit";
      else hint = `${left} left to rank`;
      const tie = R.tieNext ? '<span class="rl-tie-on">next pick ties</span>' : "";
      const strength = R.strength
        ? `<div class="rl-strength">Best vs second: <b>${R.strength}</b>` +
          (topPairRanked() ? "" : ' <span class="rl-muted">(rank a best and a second, untied)</span>') + "</div>"
        : (topPairRanked() ? '<div class="rl-strength rl-muted">0: how much better is the best?</div>' : "");
      bar.innerHTML =
        `<div class="rl-rank-title">Your ranking <span class="rl-muted">best › worst</span>${tie}</div>` +
        `<div class="rl-rank-chips">${chips}${chips && empty ? '<span class="rl-gt">›</span>' : ""}${empty}</div>` +
        strength + `<div class="rl-hint">${hint}</div>`;
    }

    // A click in this panel's item (ranking a card, or ✎ Edit on one).
    R.onClick = (e) => {
      const edit = e.target.closest && e.target.closest(sel("#rl-item .rl-edit-from"));
      if (edit) {
        startEdit(parseInt(edit.dataset.pos, 10));
        return;
      }
      const card = e.target.closest && e.target.closest(sel("#rl-item .rl-card"));
      if (!card || e.target.closest("a, button, input, textarea")) return;
      if (window.getSelection && String(window.getSelection()).length) return; // selecting text
      pick(parseInt(card.dataset.pos, 10), e.shiftKey || R.tieNext);
    };

    // A key while this panel is on screen.
    R.onKey = (e) => {
      const t = e.target;
      const typing = t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA" || t.isContentEditable);
      if (typing) {
        if (e.key === "Enter" && !e.shiftKey && t.closest(sel("#rl-comment"))) {
          e.preventDefault();
          t.blur();
          click("#rl-submit");
        } else if (e.key === "Escape") t.blur();
        return;
      }
      if (e.ctrlKey || e.metaKey || e.altKey) return;
      // Keys by their place on the keyboard (e.code), so Shift (a tie) and the layout do not matter.
      const code = /^(?:Digit|Numpad|Key)([1-9A-Z])$/.exec(e.code || "");
      const pos = code ? posOf(code[1].toLowerCase()) : 0;
      if (pos) {
        e.preventDefault();
        pick(pos, e.shiftKey || R.tieNext);
        return;
      }
      const key = e.key.length === 1 ? e.key.toLowerCase() : e.key;
      const actions = {
        Enter: () => click("#rl-submit"),
        s: () => click("#rl-skip"),
        u: () => click("#rl-undo"),
        f: () => click("#rl-flag"),
        a: () => click("#rl-allbad input"),
        c: () => $("#rl-comment textarea, #rl-comment input")?.focus(),
        e: editKey,
        t: () => { R.tieNext = !R.tieNext; paint(); },
        0: nextStrength,
        Backspace: () => { sync(); R.groups.length && R.groups[R.groups.length - 1].pop(); R.groups = R.groups.filter((g) => g.length); paint(); },
        Escape: () => { R.groups = []; R.tieNext = false; R.strength = ""; paint(); },
      };
      if (actions[key]) {
        e.preventDefault();
        actions[key]();
      }
    };

    // Gradio updates the item's HTML on every new item, sometimes in place (the same element, new
    // attributes and children): watch for a new element or a new token. Only then: paint() mutates
    // the DOM too, and reacting to that would loop.
    R.onMutation = () => {
      const it = item();
      if (it !== R.el || (it ? it.dataset.token : null) !== R.token) {
        R.el = it;
        sync();
      }
    };
    R.onInput = (e) => e.target && e.target.id === `${prefix}-edit-text` && editChanged();
    R.sync = sync;
    return R;
  }

  const panels = [(window.rlhf = makePanel("rl")), (window.rlhfChat = makePanel("rl-chat"))];
  const shown = () => panels.find((p) => visible(p.item()));
  document.addEventListener("click", (e) => panels.forEach((p) => p.onClick(e)));
  document.addEventListener("keydown", (e) => {
    const p = shown(); // only on the Annotate or the Chat tab
    if (p) p.onKey(e);
  });
  const start = () => {
    new MutationObserver(() => panels.forEach((p) => p.onMutation()))
      .observe(document.body, { childList: true, subtree: true });
    document.addEventListener("input", (e) => panels.forEach((p) => p.onInput(e)));
    panels.forEach((p) => p.sync());
  };
  if (document.body) start();
  else document.addEventListener("DOMContentLoaded", start);
})();
