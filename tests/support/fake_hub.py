#!/usr/bin/env python3
"""A fake Hugging Face Hub and CDN on 127.0.0.1 for ptk-download's tests, the benchmarks and the
main job (Python standard library only).

It serves a directory as the dataset repo NAMESPACE/NAME at one pinned commit and reproduces what
ptk-download relies on (shared/reference/hf-download.md §1-2, §7):
  GET /api/datasets/{repo}[/revision/{rev}]          -> {"id", "sha", ...}; 404 RepoNotFound/RevisionNotFound
  GET /api/datasets/{repo}/tree/{rev}?recursive=...  -> JSON entries, paginated with an absolute Link rel="next"
  GET /datasets/{repo}/resolve/{rev}/{path}          -> LFS files: 302 to the CDN host (a different authority),
      X-Linked-Size, X-Linked-Etag, X-Repo-Commit, a non-empty redirect body; small files: 200 (or 307 to
      /api/resolve-cache/... with --small-mode 307); missing: 404 EntryNotFound
  GET cdn /xet-bridge/{sha256}?Expires=..&Signature=..  -> 200, 206 + Content-Range, 416 bytes */N, If-Range, ETag
  RateLimit / RateLimit-Policy headers on every Hub response from real fixed-window counters per client;
  429 over quota (--ratelimit-mode headers | retry-after | none); gated repos (--gated): 401 / 403 GatedRepo.
Fault injection per file and attempt (--faults FILE or POST /_faults): a JSON object {path: [fault, ...]};
the k-th request for that path (CDN GET, or Hub resolve for faults prefixed "hub:") gets fault k:
  drop:K  stall:S  slow:BPS  ignore_range  slice200  bad_range_start  bad_range_total  flip:K  short
  429_ratelimit  429_retry_after:N  429_retry_date:N (Retry-After as an HTTP-date)  429_plain  503_retry_after:N  500  502  503  cdn_403  replace  ok
Hostile faults, per file at the Hub resolve ("hub:" prefix): redirect_file (302 to file:///etc/hostname),
redirect_gopher (302 to gopher://), redirect_loop (302 to itself), bad_linked_size (X-Linked-Size: 12abc); on the
CDN: bad_content_range (206 with a 30-digit Content-Range), bad_ratelimit (429 with a 30-digit RateLimit).
On the CDN: changed (the object was replaced: other bytes, ETag "v2", If-Range honoured), changed_206 (the
same, but a resume is answered 206 whatever If-Range says), range200 (a Range request answered 200 with the
Content-Range asked for, but a body that starts at byte 0, cut to the range's length), range200_full (the same with
the whole file as body), 206_no_range (206 without Content-Range); at the Hub: drip_redirect (a 302 whose body comes
one byte every 0.1 s); long_body / short_body (a 206 with the Content-Range
asked for but a body 100 bytes longer / half as long, its Content-Length counting it), long_body_unsized /
short_body_unsized (the longer / shorter body without a Content-Length, ended by closing the connection). Whole-server: --looping-listing same (every page's Link rel=next is the first page's cursor)
or fresh (a new URL every time, the same entries).
Hostile modes for the whole server: --api-redirect-loop (every API call redirects to itself), --endless-listing
(the tree listing never ends), --control-paths (the listing names files with \n, ESC, \r, TAB, BEL, DEL).
GET /_stats returns what happened (requests per path, Range headers, where Authorization went, windows, the most
CDN requests answered at once, cdn_log: each CDN request's time, Range, fault, the file's requests in flight and
the client's port, which tells its connections apart);
POST /_reset clears the statistics.

Usage: fake_hub.py --repo-dir DIR --repo ns/name [--port-file F] [--page-size N] [--quota Q --window W] ...
Prints "HUB http://127.0.0.1:P" and "CDN http://localhost:Q" (and writes them to --port-file).
"""
import argparse
import email.utils
import hashlib
import http.server
import json
import os
import socket
import socketserver
import sys
import threading
import time
import urllib.parse

COMMIT = "d6f5e0c1b2a3948576a8b9c0d1e2f3a4b5c6d7e8"


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.files = {}  # repo path -> dict(data, sha256, git_sha1, lfs)
        for root, _, names in os.walk(args.repo_dir):
            for n in names:
                full = os.path.join(root, n)
                rel = os.path.relpath(full, args.repo_dir).replace(os.sep, "/")
                data = open(full, "rb").read()
                lfs = not (rel.endswith(".md") or rel == ".gitattributes")
                self.files[rel] = {
                    "data": data,
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "git_sha1": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
                    "lfs": lfs,
                    "pointer_oid": hashlib.sha1(b"ptr" + data).hexdigest(),  # once, not per listing
                }
        self.by_sha = {f["sha256"]: p for p, f in self.files.items()}
        self.file_in_flight = {}  # repo path -> CDN requests for it being answered now
        self.faults = {}
        if args.faults:
            self.faults = json.load(open(args.faults))
        self.reset_stats()
        self.window_start = time.time()
        self.window_count = {}

    def reset_stats(self):
        self.attempts = {}  # (kind, path) -> count
        self.stats = {"resolves": {}, "cdn_gets": {}, "auth_on_cdn": 0, "auth_on_hub": 0, "hub_requests": 0,
                      "accept_encoding": 0, "windows": {}, "api_calls": 0, "rate_limited": 0, "tokens_seen": [],
                      "cdn_in_flight": 0, "cdn_max_in_flight": 0, "cdn_log": {}}

    def next_fault(self, kind, path):
        with self.lock:
            key = (kind, path)
            k = self.attempts.get(key, 0)
            self.attempts[key] = k + 1
            faults = [f for f in self.faults.get(path, [])]
            hub = [f[4:] for f in faults if f.startswith("hub:")]
            cdn = [f for f in faults if not f.startswith("hub:")]
            lst = hub if kind == "hub" else cdn
            return lst[k] if k < len(lst) else "ok"

    # Fixed-window resolver quota per client (token or address).
    def take_resolve(self, client):
        a = self.args
        with self.lock:
            now = time.time()
            w = int((now - self.window_start) // a.window)
            key = (client, w)
            used = self.window_count.get(key, 0)
            reset = a.window - ((now - self.window_start) % a.window)
            ws = self.stats["windows"].setdefault(str(w), {"served": 0, "rejected": 0})
            if used >= a.quota:
                ws["rejected"] += 1
                self.stats["rate_limited"] += 1
                return False, 0, reset
            self.window_count[key] = used + 1
            ws["served"] += 1
            return True, a.quota - used - 1, reset

    def peek_window(self, client):
        a = self.args
        with self.lock:
            now = time.time()
            w = int((now - self.window_start) // a.window)
            used = self.window_count.get((client, w), 0)
            reset = a.window - ((now - self.window_start) % a.window)
            return max(0, a.quota - used), reset


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "FakeHub/1.0"

    def log_message(self, fmt, *a):
        if self.server.state.args.verbose:
            sys.stderr.write("fake_hub: " + (fmt % a) + "\n")

    @property
    def st(self):
        return self.server.state

    def send(self, code, body=b"", headers=None, content_type="text/plain; charset=utf-8"):
        self.send_response(code)
        h = {"Content-Type": content_type, "Content-Length": str(len(body))}
        h.update(headers or {})
        for k, v in h.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def client_id(self):
        auth = self.headers.get("Authorization", "")
        return auth or self.client_address[0]

    def rl_headers(self, bucket="resolvers", left=None, reset=None):
        a = self.st.args
        if left is None:
            left, reset = self.st.peek_window(self.client_id())
        return {"RateLimit": f'"{bucket}";r={left};t={max(1, int(reset + 0.999))}',
                "RateLimit-Policy": f'"fixed window";"{bucket}";q={a.quota};w={a.window}'}

    def error(self, code, err_code, msg, extra=None):
        h = {"X-Error-Code": err_code, "X-Error-Message": msg, "X-Repo-Commit": COMMIT}
        h.update(self.rl_headers())
        h.update(extra or {})
        self.send(code, msg.encode(), h)

    def check_auth(self):
        a = self.st.args
        if not a.gated:
            return True
        auth = self.headers.get("Authorization", "")
        if not auth:
            self.error(401, "GatedRepo", "Access to this resource is restricted: please log in")
            return False
        if auth != f"Bearer {a.token}":
            self.error(403, "GatedRepo", "Access to this gated repo is not granted")
            return False
        return True

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(n) if n else b""
        if self.path == "/_faults":
            with self.st.lock:
                self.st.faults = json.loads(body or b"{}")
                self.st.attempts = {}
            return self.send(200, b"ok")
        if self.path == "/_reset":
            with self.st.lock:
                self.st.reset_stats()
            return self.send(200, b"ok")
        self.send(404, b"not found")

    def do_GET(self):
        if self.server.role == "cdn":
            return self.cdn_get()
        st = self.st
        with st.lock:
            st.stats["hub_requests"] += 1
            if self.headers.get("Authorization"):
                st.stats["auth_on_hub"] += 1
                tok = self.headers.get("Authorization")
                if tok not in st.stats["tokens_seen"]:
                    st.stats["tokens_seen"].append(tok)
            if self.headers.get("Accept-Encoding"):
                st.stats["accept_encoding"] += 1
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path)
        q = urllib.parse.parse_qs(url.query)
        repo = st.args.repo
        if path == "/_stats":
            with st.lock:
                body = json.dumps(st.stats).encode()
            return self.send(200, body, content_type="application/json")
        api = f"/api/datasets/{repo}"
        if path.startswith("/api/"):
            with st.lock:
                st.stats["api_calls"] += 1
            if st.args.api_redirect_loop:
                return self.send(302, b"", {"Location": self.path})
            if path.startswith("/api/resolve-cache/"):
                return self.resolve_cache(path)
            if not path.startswith(api):
                return self.error(401, "RepoNotFound", "Repository not found")
            if not self.check_auth():
                return
            rest = path[len(api):]
            if rest == "" or rest.startswith("/revision/"):
                rev = rest[len("/revision/"):] if rest else "main"
                if rev not in ("main", COMMIT):
                    return self.error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                body = json.dumps({"id": repo, "sha": COMMIT, "private": False, "gated": bool(st.args.gated),
                                   "siblings": [{"rfilename": p} for p in sorted(st.files)]}).encode()
                return self.send(200, body, self.rl_headers("api"), "application/json")
            if rest.startswith("/tree/"):
                rev = rest[len("/tree/"):].split("/", 1)[0]
                if rev not in ("main", COMMIT):
                    return self.error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return self.tree(q)
            return self.error(404, "EntryNotFound", "Entry not found")
        prefix = f"/datasets/{repo}/resolve/"
        if not path.startswith(prefix):
            return self.error(404, "RepoNotFound", "Repository not found")
        if not self.check_auth():
            return
        rev, _, fpath = path[len(prefix):].partition("/")
        fault = st.next_fault("hub", fpath)
        with st.lock:
            st.stats["resolves"][fpath] = st.stats["resolves"].get(fpath, 0) + 1
        ok, left, reset = st.take_resolve(self.client_id())
        if not ok or fault.startswith("429"):
            return self.too_many(fault if fault.startswith("429") else None, left, reset)
        if fault in ("500", "502", "503"):
            return self.send(int(fault), b"server error", self.rl_headers("resolvers", left, reset))
        if fault == "redirect_file":
            return self.send(302, b"", {"Location": "file:///etc/hostname"})
        if fault == "redirect_gopher":
            return self.send(302, b"", {"Location": f"gopher://127.0.0.1:{self.server.server_address[1]}/_HELLO"})
        if fault == "redirect_loop":
            return self.send(302, b"", {"Location": self.path})
        if rev not in ("main", COMMIT):
            return self.error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        f = st.files.get(fpath)
        if f is None:
            return self.error(404, "EntryNotFound", "Entry not found", self.rl_headers("resolvers", left, reset))
        h = {"X-Repo-Commit": COMMIT, "Accept-Ranges": "bytes"}
        h.update(self.rl_headers("resolvers", left, reset))
        if f["lfs"]:
            expires = int(time.time()) + st.args.url_ttl
            loc = (f"{self.server.cdn_origin}/xet-bridge/{f['sha256']}?X-Xet-Cas-Uid=public&Expires={expires}"
                   f"&Signature=fake&Key-Pair-Id=K")
            linked = "12abc" if fault == "bad_linked_size" else str(len(f["data"]))
            h.update({"Location": loc, "X-Linked-Size": linked, "X-Linked-Etag": f'"{f["sha256"]}"',
                      "ETag": f'"{f["git_sha1"]}"', "X-Xet-Hash": f["sha256"][::-1],
                      "Link": f'<{self.server.hub_origin}/api/datasets/{repo}/xet-read-token/{COMMIT}>; rel="xet-auth"'})
            if fault == "drip_redirect":
                return self.drip(302, 100000, h)
            return self.send(302, b"Found. Redirecting to the file's storage...", h)
        if st.args.small_mode == "307":
            h["Location"] = f"/api/resolve-cache/datasets/{repo}/{COMMIT}/{urllib.parse.quote(fpath)}?etag=%22{f['git_sha1']}%22"
            return self.send(307, b"Temporary Redirect", h)
        h["ETag"] = f'"{f["git_sha1"]}"'
        return self.send_body(f["data"], h, self.headers.get("Range"))

    def resolve_cache(self, path):
        parts = path.split("/")
        fpath = "/".join(parts[7:])
        f = self.st.files.get(fpath)
        if f is None:
            return self.error(404, "EntryNotFound", "Entry not found")
        return self.send_body(f["data"], {"ETag": f'"{f["git_sha1"]}"'}, self.headers.get("Range"))

    def too_many(self, fault, left, reset):
        mode = self.st.args.ratelimit_mode
        if fault == "429_ratelimit" or (fault is None and mode == "headers"):
            h = self.rl_headers("resolvers", 0, reset if fault is None else 1)
        elif (fault or "").startswith("429_retry_after") or (fault is None and mode == "retry-after"):
            secs = fault.split(":")[1] if fault and ":" in fault else str(max(1, int(reset + 0.999)))
            h = {"Retry-After": secs}
        elif (fault or "").startswith("429_retry_date"):
            # Retry-After as an HTTP-date (RFC 9110 10.2.3): N seconds from now (send_response adds the Date).
            h = {"Retry-After": email.utils.formatdate(time.time() + int(fault.split(":")[1]), usegmt=True)}
        else:
            h = {}
        body = json.dumps({"error": "You have been rate-limited; you can retry this action later."}).encode()
        self.send(429, body, h, "application/json")

    def drip(self, code, n, headers):
        self.send_response(code)
        for k, v in dict(headers, **{"Content-Length": str(n)}).items():
            self.send_header(k, v)
        self.end_headers()
        try:
            for _ in range(n):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def endless(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        try:
            self.wfile.write(b"[")
            chunk = (b'{"type": "file", "oid": "0", "size": 1, "path": "x"},' * 1000)
            while True:
                self.wfile.write(chunk)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def tree(self, q):
        st = self.st
        if st.args.endless_listing:
            return self.endless()
        entries = []
        dirs = set()
        for p in sorted(st.files):
            parts = p.split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    entries.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d})
            f = st.files[p]
            e = {"type": "file", "oid": f["git_sha1"] if not f["lfs"] else f["pointer_oid"],
                 "size": len(f["data"]), "path": p}
            if f["lfs"]:
                e["lfs"] = {"oid": f["sha256"], "size": len(f["data"]), "pointerSize": 133}
                e["xetHash"] = f["sha256"][::-1]
            entries.append(e)
        if st.args.control_paths:
            for i, bad in enumerate(["a\nb.jsonl", "esc\x1b[31m.jsonl", "cr\r.jsonl", "tab\t.jsonl", "bel\x07.jsonl",
                                     "del\x7f.jsonl"]):
                entries.append({"type": "file", "oid": "%040d" % i, "size": 1, "path": bad})
        cursor = int(q.get("cursor", ["0"])[0])
        size = st.args.page_size
        page = entries[cursor:cursor + size]
        h = self.rl_headers("api")
        with st.lock:
            st.stats["listing_pages"] = st.stats.get("listing_pages", 0) + 1
            n = st.stats["listing_pages"]
        if st.args.looping_listing == "same":
            qs = "recursive=true&expand=false&cursor=0"
            h["Link"] = f'<{self.server.hub_origin}/api/datasets/{st.args.repo}/tree/{COMMIT}?{qs}>; rel="next"'
        elif st.args.looping_listing == "fresh":
            qs = f"recursive=true&expand=false&cursor=0&n={n}"
            h["Link"] = f'<{self.server.hub_origin}/api/datasets/{st.args.repo}/tree/{COMMIT}?{qs}>; rel="next"'
        elif cursor + size < len(entries):
            qs = f"recursive=true&expand=false&cursor={cursor + size}"
            h["Link"] = f'<{self.server.hub_origin}/api/datasets/{st.args.repo}/tree/{COMMIT}?{qs}>; rel="next"'
        self.send(200, json.dumps(page).encode(), h, "application/json")

    # ---------------------------------------------------------------- CDN
    def cdn_get(self):
        st = self.st
        with st.lock:  # CDN requests being answered at once: the client's connections, bounded
            st.stats["cdn_in_flight"] += 1
            st.stats["cdn_max_in_flight"] = max(st.stats["cdn_max_in_flight"], st.stats["cdn_in_flight"])
        try:
            return self.cdn_answer()
        finally:
            with st.lock:
                st.stats["cdn_in_flight"] -= 1

    def cdn_answer(self):
        st = self.st
        url = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qs(url.query)
        with st.lock:
            if self.headers.get("Authorization"):
                st.stats["auth_on_cdn"] += 1
            if self.headers.get("Accept-Encoding"):
                st.stats["accept_encoding"] += 1
        if not url.path.startswith("/xet-bridge/"):
            return self.send(404, b"no such object")
        sha = url.path[len("/xet-bridge/"):]
        fpath = st.by_sha.get(sha)
        if fpath is None:
            return self.send(404, b"no such object")
        rng = self.headers.get("Range")
        fault = st.next_fault("cdn", fpath)
        with st.lock:
            st.stats["cdn_gets"].setdefault(fpath, []).append(rng or "")
            # When each request came (the server's clock), what it asked and got, and how many
            # requests for this file were being answered then, itself included.
            n = st.file_in_flight.get(fpath, 0) + 1
            st.file_in_flight[fpath] = n
            st.stats["cdn_log"].setdefault(fpath, []).append(
                {"t": time.time(), "range": rng or "", "fault": fault, "in_flight": n, "port": self.client_address[1]})
        try:
            return self.cdn_file(fpath, sha, q, rng, fault)
        finally:
            with st.lock:
                st.file_in_flight[fpath] -= 1

    def cdn_file(self, fpath, sha, q, rng, fault):
        st = self.st
        expires = int(q.get("Expires", ["0"])[0])
        if fault == "cdn_403" or expires < time.time():
            body = b"<?xml version=\"1.0\"?><Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"
            return self.send(403, body, content_type="application/xml")
        if fault in ("500", "502", "503"):
            return self.send(int(fault), b"server error")
        if fault.startswith("503_retry_after:"):
            return self.send(503, b"slow down", {"Retry-After": fault.split(":")[1]})
        if fault.startswith("429"):
            return self.too_many(fault, 0, 1)
        if fault == "bad_content_range":
            return self.send(206, b"x", {"Content-Range": "bytes 0-999999999999999999999999999999/1000000000000000000000000000000"})
        if fault == "bad_ratelimit":
            return self.send(429, b"{}", {"RateLimit": '"resolvers";r=999999999999999999999999999999;t=999999999999999999999999999999'})
        data = st.files[fpath]["data"]
        etag = f'"{sha}"'
        if fault == "replace":
            data = bytes(b ^ 0x55 for b in data)  # an old version of the object
            etag = '"old-version"'
        if fault in ("changed", "changed_206"):
            data = bytes(b ^ 0x5A for b in data)  # a new version of the object
            etag = '"v2"'
        return self.send_body(data, {"ETag": etag, "Accept-Ranges": "bytes"}, rng, fault)

    def send_body(self, data, headers, rng, fault="ok"):
        n = len(data)
        start, end = 0, n - 1
        status = 200
        if_range = self.headers.get("If-Range")
        if fault == "changed_206":
            if_range = None  # a broken cache: answers the range of the new object whatever If-Range says
        if rng and fault != "ignore_range" and not (if_range and if_range != headers.get("ETag")):
            spec = rng.replace("bytes=", "")
            a, _, b = spec.partition("-")
            start = int(a)
            end = int(b) if b else n - 1
            if start >= n:
                return self.send(416, b"", dict(headers, **{"Content-Range": f"bytes */{n}"}))
            status = 206
        h = dict(headers)
        if status == 206 or fault == "slice200":
            if fault == "bad_range_start":
                h["Content-Range"] = f"bytes {start + 5}-{end}/{n}"
            elif fault == "bad_range_total":
                h["Content-Range"] = f"bytes {start}-{end}/{n + 7}"
            else:
                h["Content-Range"] = f"bytes {start}-{end}/{n}"
            if fault == "slice200":
                status = 200
        body = bytearray(data[start:end + 1])
        if status == 206 and fault in ("range200", "range200_full"):
            status = 200  # the Content-Range asked for, but the body starts at byte 0
            body = bytearray(data if fault == "range200_full" else data[:end + 1 - start])
        if status == 206 and fault == "206_no_range":
            del h["Content-Range"]
        length = None  # the Content-Length sent: the body's, unless a fault lies about it
        if status == 206 and fault == "long_body":  # more bytes than the Content-Range says, counted
            body += bytes(body[:100])
        if status == 206 and fault == "short_body":  # fewer bytes than the Content-Range says, counted
            del body[len(body) // 2:]
        if status == 206 and fault == "long_body_unsized":  # more bytes, no Content-Length, then close
            body += bytes(body[:100])
            length = ""
        if status == 206 and fault == "short_body_unsized":  # fewer bytes, no Content-Length, then close
            del body[len(body) // 2:]
            length = ""
        if fault.startswith("flip:"):
            k = int(fault.split(":")[1]) - start
            if 0 <= k < len(body):
                body[k] ^= 0xFF
        self.send_response(status)
        h["Content-Type"] = "application/octet-stream"
        if length is None:
            h["Content-Length"] = str(len(body))
        else:
            h["Connection"] = "close"  # the body ends where the connection does
            self.close_connection = True
        for k, v in h.items():
            self.send_header(k, v)
        self.end_headers()
        if fault.startswith("drop:") or fault == "short" or fault == "replace":
            cut = int(fault.split(":")[1]) if fault.startswith("drop:") else len(body) // 2
            self.wfile.write(bytes(body[:cut]))
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if fault.startswith("stall:"):
            half = len(body) // 2
            self.wfile.write(bytes(body[:half]))
            self.wfile.flush()
            time.sleep(float(fault.split(":")[1]))
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        bps = float(fault.split(":")[1]) if fault.startswith("slow:") else self.st.args.bytes_per_second
        try:
            if bps and bps > 0:
                step = max(1024, int(bps / 20))
                for i in range(0, len(body), step):
                    self.wfile.write(bytes(body[i:i + step]))
                    self.wfile.flush()
                    time.sleep(step / bps)
            else:
                self.wfile.write(bytes(body))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a real server's backlog; the default 5 drops parallel SYNs (1 s retransmits)
    allow_reuse_address = True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo-dir", required=True)
    ap.add_argument("--repo", default="cerebras/SlimPajama-627B")
    ap.add_argument("--port-file", default=None)
    ap.add_argument("--hub-port", type=int, default=0)
    ap.add_argument("--cdn-port", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=1000)
    ap.add_argument("--quota", type=int, default=3000)
    ap.add_argument("--window", type=float, default=300)
    ap.add_argument("--ratelimit-mode", choices=["headers", "retry-after", "none"], default="headers")
    ap.add_argument("--gated", action="store_true")
    ap.add_argument("--token", default="hf_secret_test_token")
    ap.add_argument("--small-mode", choices=["200", "307"], default="200")
    ap.add_argument("--url-ttl", type=int, default=3600)
    ap.add_argument("--bytes-per-second", type=float, default=0)
    ap.add_argument("--faults", default=None)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--api-redirect-loop", action="store_true")
    ap.add_argument("--endless-listing", action="store_true")
    ap.add_argument("--control-paths", action="store_true")
    ap.add_argument("--looping-listing", choices=["same", "fresh"], default=None)
    a = ap.parse_args()
    state = State(a)
    hub = Server(("127.0.0.1", a.hub_port), Handler)
    cdn = Server(("127.0.0.1", a.cdn_port), Handler)
    for s, role in ((hub, "hub"), (cdn, "cdn")):
        s.state = state
        s.role = role
        s.hub_origin = f"http://127.0.0.1:{hub.server_address[1]}"
        s.cdn_origin = f"http://localhost:{cdn.server_address[1]}"
    for s in (hub, cdn):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    lines = f"HUB {hub.hub_origin}\nCDN {hub.cdn_origin}\n"
    if a.port_file:
        tmp = a.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(lines)
        os.rename(tmp, a.port_file)
    sys.stdout.write(lines)
    sys.stdout.flush()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
