package schedule

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"go.yaml.in/yaml/v3"
)

// A schedule file (IDEMQ_SCHEDULE_FILE) is YAML:
//
//	entries:
//	  - name: settle-hourly
//	    schedule: "0 * * * *"
//	    time_zone: Europe/Berlin
//	    task_type: wallet:settle
//	    payload: {period: hour}
//	    catch_up: all
//	    catch_up_window: 6h
//	    overlap: skip

// fileEntry is an entry as a schedule file spells it: durations as Go durations ("90s").
type fileEntry struct {
	Name          string `yaml:"name"`
	Schedule      string `yaml:"schedule"`
	TimeZone      string `yaml:"time_zone"`
	TaskType      string `yaml:"task_type"`
	Payload       any    `yaml:"payload"`
	Queue         string `yaml:"queue"`
	MaxRetry      int    `yaml:"max_retry"`
	Timeout       string `yaml:"timeout"`
	CatchUp       string `yaml:"catch_up"`
	CatchUpWindow string `yaml:"catch_up_window"`
	Overlap       string `yaml:"overlap"`
}

// ReadFile reads and checks the schedule file at path (see ParseFile).
func ReadFile(path string) ([]Entry, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("schedule: %w", err)
	}
	entries, err := ParseFile(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return entries, nil
}

// ParseFile reads a schedule file's YAML: a mapping with one key, entries, a list of
// entries whose fields are Entry's JSON names (durations as Go durations, "90s"; the
// payload any YAML mapping, stored as JSON). An unknown field is an error, and every
// entry is checked as Validate checks it: the errors name the entry and the field.
func ParseFile(b []byte) ([]Entry, error) {
	var f struct {
		Entries []fileEntry `yaml:"entries"`
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("schedule: %w", err)
	}
	var errs []error
	entries := make([]Entry, 0, len(f.Entries))
	for i, fe := range f.Entries {
		label := fmt.Sprintf("%q", fe.Name)
		if fe.Name == "" {
			label = fmt.Sprintf("#%d", i+1)
		}
		e, err := fe.entry(label)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		entries = append(entries, e)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if err := Validate(entries); err != nil {
		return nil, err
	}
	return entries, nil
}

func (fe fileEntry) entry(label string) (Entry, error) {
	e := Entry{Name: fe.Name, Schedule: fe.Schedule, TimeZone: fe.TimeZone, TaskType: fe.TaskType,
		Queue: fe.Queue, MaxRetry: fe.MaxRetry, CatchUp: CatchUp(fe.CatchUp), Overlap: Overlap(fe.Overlap)}
	if fe.Payload != nil {
		b, err := json.Marshal(fe.Payload)
		if err != nil {
			return e, &EntryError{Entry: label, Field: "payload", Err: fmt.Errorf("not representable as JSON: %v", err)}
		}
		e.Payload = b
	}
	for _, d := range []struct {
		field string
		text  string
		out   *time.Duration
	}{{"timeout", fe.Timeout, &e.Timeout}, {"catch_up_window", fe.CatchUpWindow, &e.CatchUpWindow}} {
		if d.text == "" {
			continue
		}
		v, err := time.ParseDuration(d.text)
		if err != nil {
			return e, &EntryError{Entry: label, Field: d.field, Err: fmt.Errorf("%q is not a duration (e.g. 90s, 6h)", d.text)}
		}
		*d.out = v
	}
	return e, nil
}
