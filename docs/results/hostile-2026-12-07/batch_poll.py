import json, sys, time, urllib.request
url, token, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
prev = None
end = time.time() + secs
while time.time() < end:
    req = urllib.request.Request(url + "/stats", headers={"Authorization": "Bearer " + token})
    b = json.load(urllib.request.urlopen(req))["batching"]
    rows = b["mean_batch"] * b["batches"]
    if prev and b["batches"] > prev[0]:
        print(f"{time.strftime('%H:%M:%S')} batches/s {(b['batches']-prev[0])/0.5:.0f} mean batch {(rows-prev[1])/(b['batches']-prev[0]):.2f} last {b['last_batch']}", flush=True)
    prev = (b["batches"], rows)
    time.sleep(0.5)
