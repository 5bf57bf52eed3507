"""The Redis store's Lua scripts. Each touches keys of one hash tag (one cluster slot)."""

from __future__ import annotations

# Tenant creation, phase 1. KEYS: tenant hash, keys hash, creating marker (one tenant).
# ARGV: marker TTL ms. 'id' if the tenant exists or is being created, else 'ok'.
RESERVE_TENANT = """
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then
  return 'id'
end
if not redis.call('SET', KEYS[3], '1', 'NX', 'PX', ARGV[1]) then return 'id' end
return 'ok'
"""

# Tenant creation, last phase. KEYS: tenant hash, keys hash, creating marker.
# ARGV: name, tenant_id, api_key_hash, created_at, scopes_json, key_version, key_json
COMMIT_TENANT = """
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then
  return 'id'
end
redis.call('HSET', KEYS[1], 'tenant_id', ARGV[2], 'name', ARGV[1],
           'api_key_hash', ARGV[3], 'created_at', ARGV[4], 'scopes', ARGV[5])
redis.call('HSET', KEYS[2], ARGV[6], ARGV[7])
redis.call('DEL', KEYS[3])
return 'ok'
"""

# A uniqueness claim in a global hash. KEYS: the hash. ARGV: field, expected holder,
# new holder ('' deletes). 1 if the field held the expected value and was changed.
SWAP_HASH_CLAIM = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
if ARGV[3] == '' then redis.call('HDEL', KEYS[1], ARGV[1])
else redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]) end
return 1
"""

# A uniqueness claim held by a global string key. KEYS: the key. ARGV: expected holder.
# Deleted (1) only if it still names that holder.
RELEASE_CLAIM = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS: tenant hash, keys hash. ARGV: version, key_json.
# Versions are contiguous from 1, so HLEN is the latest version.
# Returns {1, latest} on success, {0, latest} on a version mismatch, {-1, 0} if no tenant.
ADD_KEY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0} end
local latest = redis.call('HLEN', KEYS[2])
if tonumber(ARGV[1]) ~= latest + 1 then return {0, latest} end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {1, latest}
"""

# Re-wrapped key blobs of one tenant, compare-and-set. KEYS: keys hash.
# ARGV: version, expected JSON, new JSON, ... Returns 1 when all were written, 0 if
# one changed since it was read (nothing written), -version if a version is missing.
REPLACE_KEYS = """
for i = 1, #ARGV, 3 do
  local cur = redis.call('HGET', KEYS[1], ARGV[i])
  if not cur then return -tonumber(ARGV[i]) end
  if cur ~= ARGV[i + 1] then return 0 end
end
for i = 1, #ARGV, 3 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2]) end
return 1
"""

# Registry allocation, phase 1 (tenant slot). KEYS: msgseq, bit-length set of the key
# version, live counter of (key version, bits). ARGV: num_bits, max id (-1: none).
# The new id, or -1 (nothing written). The live counter counts the id now: should the
# entry's write fail, it over-counts by one (a conservative registry-size correction).
NEXT_ID = """
local max = tonumber(ARGV[2])
if max >= 0 and tonumber(redis.call('GET', KEYS[1]) or '0') >= max then return -1 end
local id = redis.call('INCR', KEYS[1])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('INCR', KEYS[3])
return id
"""

# Bulk ids (tenant slot), as NEXT_ID for ARGV[2] ids at once. KEYS: as NEXT_ID.
# ARGV: num_bits, count. Returns the last id.
NEXT_IDS = """
local last = redis.call('INCRBY', KEYS[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('INCRBY', KEYS[3], ARGV[2])
return last
"""

# Retention counters (tenant slot). KEYS: live counter, expired counter. ARGV: n.
MOVE_EXPIRED = """
redis.call('DECRBY', KEYS[1], ARGV[1])
redis.call('INCRBY', KEYS[2], ARGV[1])
return 1
"""

# Registry retention. KEYS: the watermark. ARGV: the new watermark (it never goes back).
ADVANCE_WATERMARK = """
if tonumber(ARGV[1]) > tonumber(redis.call('GET', KEYS[1]) or '0') then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
"""

# KEYS: an index zset (one bucket). ARGV: ids separated by spaces.
# Returns the 1-based positions of the ids in the index: a few integers, however many
# were asked (ZMSCORE would send back, and redis-py parse, one reply per id).
ISSUED_AMONG = """
local out, i = {}, 0
for id in string.gmatch(ARGV[1], '%S+') do
  i = i + 1
  if redis.call('ZSCORE', KEYS[1], id) then out[#out + 1] = i end
end
return out
"""

# Registry allocation, phase 2 (bucket slot). KEYS: bucket hash, bucket index zset.
# ARGV: id, entry JSON. 1 when written (or this very entry is already there: a retried
# write), 0 if the id holds another entry (nothing written).
PUT_ENTRY = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  if cur == ARGV[2] then return 1 end
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
return 1
"""

# KEYS: bucket hash. ARGV: id, fingerprint (hex). 1 if set, 0 if the id holds no entry.
# The entry's JSON gets (or has replaced) a last top-level field "fingerprint": the
# anchored pattern only meets that field, never one inside the metadata (which is
# followed by at least one more '}'). Idempotent: a retry writes the same value.
SET_FINGERPRINT = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local base = (string.gsub(cur, ',"fingerprint":"%x*"}$', '}'))
redis.call('HSET', KEYS[1], ARGV[1],
  string.sub(base, 1, -2) .. ',"fingerprint":"' .. ARGV[2] .. '"}')
return 1
"""

# KEYS: bucket hash, bucket index zset. ARGV: id. 1 if an entry was removed.
VOID_ENTRY = """
local removed = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return removed
"""

# KEYS: tenant hash. ARGV: scopes JSON. 1 if updated, 0 if no such tenant.
SET_SCOPES = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'scopes', ARGV[1])
return 1
"""

# Token bucket. KEYS: bucket hash, this debit's record. ARGV: rate per second, burst,
# cost, record TTL ms. Redis's own clock (TIME) so every replica of the API shares one
# time base. Idempotent: the decision is recorded (KEYS[2], with the debit, so a
# promoted replica has both or neither) and a retried call gets it back, debiting once.
# Returns {allowed, retry_after_s, tokens_left} (floats as strings).
TAKE_TOKENS = """
local done = redis.call('GET', KEYS[2])
if done then
  local out = {}
  for v in string.gmatch(done, '%S+') do out[#out + 1] = v end
  out[1] = tonumber(out[1])
  return out
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local h = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(h[1]), tonumber(h[2])
if tokens == nil or ts == nil then tokens, ts = burst, now end
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed, retry = 0, (cost - tokens) / rate
if tokens >= cost then
  tokens, allowed, retry = tokens - cost, 1, 0
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens),
           'ts', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
local out = {allowed, string.format('%.6f', retry), string.format('%.6f', tokens)}
redis.call('SET', KEYS[2], table.concat(out, ' '), 'PX', ARGV[4])
return out
"""

# KEYS: apikeys hash, revoked hash. ARGV: key id, time. 0 if no such key.
REVOKE_API_KEY = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# Sliding-window probe counter. KEYS: hits zset, sketch key, band keys...
# ARGV: window ms, budget, cluster id, sketch ('' keeps the old one), this hit's id,
# then for an open (Store.probe_open) min_hits and the cluster ids already seen (0 and
# none for a plain hit). Redis's clock, so every replica shares one time base.
# Idempotent: the hit's id is its member, so a retried call whose hit is already
# counted is not counted again. Returns {allowed, count, retry_after_ms}, or {-1, 0, 0}
# for an open that found min_hits of its bands pointing to one cluster not seen.
PROBE_HIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window, budget = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local count = redis.call('ZCARD', KEYS[1])
if redis.call('ZSCORE', KEYS[1], ARGV[5]) then return {1, count, 0} end
local need = tonumber(ARGV[6])
if need > 0 then
  local seen, hits = {[ARGV[3]] = true}, {}
  for i = 7, #ARGV do seen[ARGV[i]] = true end
  for i = 3, #KEYS do
    local ref = redis.call('GET', KEYS[i])
    if ref and not seen[ref] then
      hits[ref] = (hits[ref] or 0) + 1
      if hits[ref] >= need then return {-1, 0, 0} end
    end
  end
end
if count >= budget then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  local retry = window
  if oldest[2] then retry = tonumber(oldest[2]) + window - now end
  return {0, count, retry}
end
redis.call('ZADD', KEYS[1], now, ARGV[5])
redis.call('PEXPIRE', KEYS[1], window)
if ARGV[4] ~= '' then
  redis.call('SET', KEYS[2], ARGV[4], 'PX', window)
  for i = 3, #KEYS do redis.call('SET', KEYS[i], ARGV[3], 'PX', window) end
else
  redis.call('PEXPIRE', KEYS[2], window)
end
return {1, count + 1, 0}
"""

# Counts of several probe clusters, all or none (Store.probe_hit_all). KEYS: per
# cluster its hits zset and its sketch key. ARGV: window ms, budget, this call's id,
# the count-only sketch, then each cluster's number of hits. Every cluster's count plus
# its number must be within the budget, else nothing is recorded. Idempotent: the
# members are the call's id and an index, so a retried call counted already is not
# counted again. Returns 1 counted, 0 refused.
PROBE_HIT_ALL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window, budget, op = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local n = #KEYS / 2
for i = 1, n do
  local hits = KEYS[2 * i - 1]
  redis.call('ZREMRANGEBYSCORE', hits, '-inf', now - window)
  if redis.call('ZSCORE', hits, op .. ':' .. i .. ':1') then return 1 end
end
for i = 1, n do
  if redis.call('ZCARD', KEYS[2 * i - 1]) + tonumber(ARGV[4 + i]) > budget then return 0 end
end
for i = 1, n do
  local hits = KEYS[2 * i - 1]
  for j = 1, tonumber(ARGV[4 + i]) do redis.call('ZADD', hits, now, op .. ':' .. i .. ':' .. j) end
  redis.call('PEXPIRE', hits, window)
  redis.call('SET', KEYS[2 * i], ARGV[4], 'PX', window)
end
return 1
"""

# One issued text's contexts into a tenant's context sketch (worldcup_core.context_sketch:
# conservative update from the counters before the text; a counter two contexts share
# takes the larger). KEYS: the sketch string (one byte a counter, row-major). ARGV: the
# sketch depth, then the text's distinct contexts' flat counter indices, context-major.
# Commands of at most 1000 counters each (Lua's unpack has a limit).
COUNT_CONTEXTS = """
local depth = tonumber(ARGV[1])
local chunk = 1000
local cur = {}
for s = 2, #ARGV, chunk do
  local ops = {}
  for i = s, math.min(s + chunk - 1, #ARGV) do
    ops[#ops + 1] = 'GET'; ops[#ops + 1] = 'u8'; ops[#ops + 1] = '#' .. ARGV[i]
  end
  for _, v in ipairs(redis.call('BITFIELD', KEYS[1], unpack(ops))) do cur[#cur + 1] = v end
end
local best = {}
for c = 0, #cur / depth - 1 do
  local low = 255
  for r = 1, depth do
    if cur[c * depth + r] < low then low = cur[c * depth + r] end
  end
  local target = math.min(low + 1, 255)
  for r = 1, depth do
    local i = c * depth + r
    local cell = ARGV[i + 1]
    if cur[i] < target and (best[cell] or 0) < target then best[cell] = target end
  end
end
local ops = {}
for cell, v in pairs(best) do
  ops[#ops + 1] = 'SET'; ops[#ops + 1] = 'u8'; ops[#ops + 1] = '#' .. cell; ops[#ops + 1] = v
  if #ops >= 4 * chunk then redis.call('BITFIELD', KEYS[1], unpack(ops)); ops = {} end
end
if #ops > 0 then redis.call('BITFIELD', KEYS[1], unpack(ops)) end
return 1
"""

# The counters of a tenant's context sketch. KEYS: the sketch string. ARGV: flat
# counter indices. Their values (0 for a missing key or past its end).
READ_CONTEXTS = """
local out = {}
for s = 1, #ARGV, 1000 do
  local ops = {}
  for i = s, math.min(s + 999, #ARGV) do
    ops[#ops + 1] = 'GET'; ops[#ops + 1] = 'u8'; ops[#ops + 1] = '#' .. ARGV[i]
  end
  for _, v in ipairs(redis.call('BITFIELD_RO', KEYS[1], unpack(ops))) do out[#out + 1] = v end
end
return out
"""
