-- Publish a policy record in one atomic step: SET the record, then PUBLISH it on the announce channel.
-- KEYS: record   ARGV: record JSON, channel
-- The PERSIST first (a write that grows nothing: the record has no TTL) lets the SET through when Redis is
-- past its maxmemory (Redis refuses only a script's first memory-growing write): the record replaces one
-- of its own size, and the actors must hear of every version the learner trains.
redis.call('PERSIST', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1])
return redis.call('PUBLISH', ARGV[2], ARGV[1])
