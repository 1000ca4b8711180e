// Package asynqkeys names where asynq keeps its data in Redis (its internal base package's
// key layout), for the few places that read or write it directly: the outbox's presence
// checks and queue registration, and the middleware's guarded result write. The test
// fails if an asynq upgrade moves them.
package asynqkeys

// AllQueues is the set of every queue's name (asynq's base.AllQueues).
const AllQueues = "asynq:queues"

// Task is the hash holding a task's message, state and result (asynq's base.TaskKey).
func Task(queue, id string) string { return "asynq:{" + queue + "}:t:" + id }

// QueuePattern matches (as a SCAN pattern) every key asynq keeps for queue: its lists,
// sets and task hashes, all under the queue's hash tag.
func QueuePattern(queue string) string { return "asynq:{" + queue + "}:*" }
