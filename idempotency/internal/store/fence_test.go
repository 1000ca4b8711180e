package store

import (
	"strings"
	"testing"
)

// Every fenced write checks the fence and owner, and its unsafe twin (the negative
// control's) checks neither: the two differ only in their fence checks.
func TestFencedWritesAndTheirUnsafeTwins(t *testing.T) {
	t.Parallel()
	safe, unsafe := Fenced, Unfenced
	pairs := map[string][2]string{
		"heartbeat":     {safe.Heartbeat, unsafe.Heartbeat},
		"finishMany":    {safe.FinishMany.SQL, unsafe.FinishMany.SQL},
		"finishTxMany":  {safe.FinishTxMany, unsafe.FinishTxMany},
		"storeResultTx": {safe.StoreResultTx, unsafe.StoreResultTx},
	}
	if safe.FinishMany.Name == unsafe.FinishMany.Name {
		t.Errorf("the unsafe finish is prepared under the safe one's name %q", safe.FinishMany.Name)
	}
	for name, p := range pairs {
		f, u := p[0], p[1]
		if !strings.Contains(f, checkFence.args) && !strings.Contains(f, checkFence.rows) {
			t.Errorf("%s does not check the fence:\n%s", name, f)
		}
		if strings.Contains(u, checkFence.args) || strings.Contains(u, checkFence.rows) {
			t.Errorf("the unsafe %s still checks the fence:\n%s", name, u)
		}
		back := strings.NewReplacer(checkNothing.args, checkFence.args, checkNothing.rows, checkFence.rows).Replace(u)
		if back != f {
			t.Errorf("%s and its unsafe twin differ beyond their fence checks", name)
		}
	}
}
