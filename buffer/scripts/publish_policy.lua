-- Publish a policy record in one atomic step: SET the record, then PUBLISH it on the announce channel.
-- KEYS: record   ARGV: record JSON, channel
redis.call('SET', KEYS[1], ARGV[1])
return redis.call('PUBLISH', ARGV[2], ARGV[1])
