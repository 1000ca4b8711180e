-- A fragment: the condition on an outbox intent j, joined to a finished row's parameters
-- r, under which the finish settles it: the delivery was of the intent's own task
-- (r.intent_sum, see FinishParams.IntentSum), or the caller did not say (NULL).
(r.intent_sum IS NULL OR j.payload_sha256 = r.intent_sum)
