package store

import (
	"strings"
	"testing"
)

// Every fenced write checks the fence and owner, and its unsafe twin (the negative
// control's) checks neither, nor takes a DoTx key's lock, nor re-checks a DoTx row at
// its finish, nor guards the finish: the two differ only in their fence checks.
func TestFencedWritesAndTheirUnsafeTwins(t *testing.T) {
	t.Parallel()
	safe, unsafe := Fenced, Unfenced
	pairs := map[string][2]string{
		"heartbeat":  {safe.Heartbeat, unsafe.Heartbeat},
		"finishMany": {safe.FinishMany.SQL, unsafe.FinishMany.SQL},
		"holdKeys":   {safe.HoldKeys, unsafe.HoldKeys},
		"finishTx":   {safe.FinishTx, unsafe.FinishTx},
	}
	if safe.FinishMany.Name == unsafe.FinishMany.Name {
		t.Errorf("the unsafe finish is prepared under the safe one's name %q", safe.FinishMany.Name)
	}
	for name, p := range pairs {
		f, u := p[0], p[1]
		checks := func(sql string, c fenceChecks) bool {
			return strings.Contains(sql, c.Args) || strings.Contains(sql, c.Rows) || strings.Contains(sql, c.Hold) || strings.Contains(sql, c.HoldWait) ||
				strings.Contains(sql, c.Conflict) || strings.Contains(sql, c.Takeover) || strings.Contains(sql, c.Guard)
		}
		if !checks(f, checkFence) {
			t.Errorf("%s does not check the fence:\n%s", name, f)
		}
		if checks(u, checkFence) {
			t.Errorf("the unsafe %s still checks the fence:\n%s", name, u)
		}
		back := strings.NewReplacer(checkNothing.Args, checkFence.Args, checkNothing.Rows, checkFence.Rows,
			checkNothing.Hold, checkFence.Hold, checkNothing.HoldWait, checkFence.HoldWait, checkNothing.Conflict, checkFence.Conflict, checkNothing.Takeover, checkFence.Takeover,
			checkNothing.Guard, checkFence.Guard).Replace(u)
		if back != f {
			t.Errorf("%s and its unsafe twin differ beyond their fence checks", name)
		}
	}
}
