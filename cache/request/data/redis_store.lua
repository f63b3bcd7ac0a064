-- The Redis store's writes in one script each, so an entry, its pointer, tags, expiry and LRU ranks, the byte totals
-- and the stream event change together (cache/request/redis_store.py). Keys are built here from ARGV[1], the prefix:
--   P:ids           HASH  entry id -> JSON [namespace, tenant, size, tags]   (the pointer: finds an entry by id)
--   P:NS:e:ID       HASH  the entry (NS = quoted tenant ":" quoted model), expires with the entry's TTL
--   P:tag:TAG       SET   entry ids;  P:exp ZSET id -> expiry ms;  P:lru, P:lru:QTENANT  ZSET id -> last use ms
--   P:bytes         HASH  tenant -> bytes held;  P:stream  STREAM of {op, ids, origin}
-- Needs standalone Redis/Valkey >= 7 (keys are computed in the script, so no Cluster).

local P = ARGV[1]
local op = ARGV[2]
local origin = ARGV[3]
local maxlen = ARGV[4]

local function qtenant(ptr)
    return string.match(ptr[1], "^[^:]*")
end

-- Delete one entry and everything pointing at it; returns its size (0 when absent).
local function drop(id)
    local raw = redis.call("HGET", P .. ":ids", id)
    if not raw then
        return 0
    end
    local ptr = cjson.decode(raw)
    redis.call("HDEL", P .. ":ids", id)
    redis.call("DEL", P .. ":" .. ptr[1] .. ":e:" .. id)
    for _, tag in ipairs(ptr[4]) do
        redis.call("SREM", P .. ":tag:" .. tag, id)
    end
    redis.call("ZREM", P .. ":exp", id)
    redis.call("ZREM", P .. ":lru", id)
    redis.call("ZREM", P .. ":lru:" .. qtenant(ptr), id)
    if redis.call("HINCRBY", P .. ":bytes", ptr[2], -ptr[3]) <= 0 then
        redis.call("HDEL", P .. ":bytes", ptr[2])
    end
    return ptr[3]
end

local function totals()
    return {redis.call("HLEN", P .. ":ids"), redis.call("HGETALL", P .. ":bytes")}
end

local function announce(kind, ids)
    if #ids > 0 then
        redis.call("XADD", P .. ":stream", "MAXLEN", "~", maxlen, "*", "op", kind, "ids", table.concat(ids, ","),
            "origin", origin)
    end
end

-- Evict until `need` bytes are freed: expired entries first, then `zset` in rank order (least recently used first);
-- `tenant` limits both passes to one tenant's entries. Pages through the sets, so a write never reads all of them.
local function choose(need, zset, tenant, now_ms, victims, reasons, reason)
    local freed = 0
    for _, pass in ipairs({{"expired", P .. ":exp", true}, {reason, zset, false}}) do
        local skipped = 0
        while freed < need do
            local batch
            if pass[3] then
                batch = redis.call("ZRANGEBYSCORE", pass[2], "-inf", now_ms, "LIMIT", skipped, 64)
            else
                batch = redis.call("ZRANGE", pass[2], skipped, skipped + 63)
            end
            if #batch == 0 then
                break
            end
            for _, id in ipairs(batch) do
                if freed >= need then
                    break
                end
                local raw = redis.call("HGET", P .. ":ids", id)
                if not raw then
                    redis.call("ZREM", pass[2], id)         -- a stale rank: nothing to free
                elseif tenant == nil or cjson.decode(raw)[2] == tenant then
                    freed = freed + drop(id)
                    victims[#victims + 1] = id
                    reasons[#reasons + 1] = pass[1]
                else
                    skipped = skipped + 1
                end
            end
        end
    end
    return freed
end

if op == "put" then
    -- ARGV: 5 id, 6 pointer JSON, 7 expires ms, 8 now ms, 9 max bytes, 10 tenant max bytes, 11.. entry field pairs
    local id, raw = ARGV[5], ARGV[6]
    local ptr = cjson.decode(raw)
    local tenant, size = ptr[2], ptr[3]
    local now_ms, max_bytes, tenant_max = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
    drop(id)
    local held = tonumber(redis.call("HGET", P .. ":bytes", tenant) or "0")
    local total = 0
    for _, n in ipairs(redis.call("HVALS", P .. ":bytes")) do
        total = total + tonumber(n)
    end
    local victims, reasons = {}, {}
    if tenant_max < max_bytes and held + size > tenant_max then
        total = total - choose(held + size - tenant_max, P .. ":lru:" .. qtenant(ptr), tenant, now_ms, victims, reasons,
            "tenant_lru")
    end
    if total + size > max_bytes then
        choose(total + size - max_bytes, P .. ":lru", nil, now_ms, victims, reasons, "lru")
    end
    local key = P .. ":" .. ptr[1] .. ":e:" .. id
    local fields = {}
    for i = 11, #ARGV do
        fields[#fields + 1] = ARGV[i]
    end
    redis.call("HSET", key, unpack(fields))
    redis.call("PEXPIREAT", key, ARGV[7])
    redis.call("HSET", P .. ":ids", id, raw)
    for _, tag in ipairs(ptr[4]) do
        local tkey = P .. ":tag:" .. tag
        redis.call("SADD", tkey, id)
        if redis.call("PTTL", tkey) < 0 then
            redis.call("PEXPIREAT", tkey, ARGV[7])
        else
            redis.call("PEXPIREAT", tkey, ARGV[7], "GT")
        end
    end
    redis.call("ZADD", P .. ":exp", ARGV[7], id)
    redis.call("ZADD", P .. ":lru", now_ms, id)
    redis.call("ZADD", P .. ":lru:" .. qtenant(ptr), now_ms, id)
    redis.call("HINCRBY", P .. ":bytes", tenant, size)
    redis.call("DEL", P .. ":lease:" .. id)
    announce("del", victims)
    announce("put", {id})
    return {victims, reasons, totals()}
elseif op == "delete" then
    -- ARGV: 5.. entry ids
    local gone = {}
    for i = 5, #ARGV do
        if drop(ARGV[i]) > 0 then
            gone[#gone + 1] = ARGV[i]
        end
    end
    announce("del", gone)
    return {gone, {}, totals()}
elseif op == "get" then
    -- ARGV: 5 id -> the entry's fields, or nothing (absent or expired)
    local raw = redis.call("HGET", P .. ":ids", ARGV[5])
    if not raw then
        return {}
    end
    return redis.call("HGETALL", P .. ":" .. cjson.decode(raw)[1] .. ":e:" .. ARGV[5])
elseif op == "touch" then
    -- ARGV: 5 id, 6 hits, 7 last hit (s), 8 last hit (ms)
    local raw = redis.call("HGET", P .. ":ids", ARGV[5])
    if raw then
        local ptr = cjson.decode(raw)
        local key = P .. ":" .. ptr[1] .. ":e:" .. ARGV[5]
        if redis.call("EXISTS", key) == 1 then
            redis.call("HSET", key, "hits", ARGV[6], "last_hit", ARGV[7])
            redis.call("ZADD", P .. ":lru", "XX", ARGV[8], ARGV[5])
            redis.call("ZADD", P .. ":lru:" .. qtenant(ptr), "XX", ARGV[8], ARGV[5])
        end
    end
    return {}
end
return redis.error_reply("unknown op " .. op)
