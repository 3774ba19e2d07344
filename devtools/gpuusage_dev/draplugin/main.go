// gpuusage-dra-plugin is a DRA driver of ours for the local cluster's real node: a kubelet
// plugin under the name of NVIDIA's GPU driver (gpu.nvidia.com), as our device plugin stands
// in for NVIDIA's device plugin. It is built on the upstream helper
// (k8s.io/dynamic-resource-allocation/kubeletplugin), which serves the kubelet's plugin
// registration socket and the DRA gRPC socket and publishes ResourceSlices.
//
// What it publishes comes ready-made from a JSON file that the Python wrapper writes from a GPU
// scenario (draplugin/__init__.py): the pool's slices in the resource.k8s.io/v1 shape, and for
// each device what preparing it means (its UUID, or for a MIG device created at prepare time its
// parent and profile). Preparing a claim writes one CDI spec file per claim into --cdi-dir (kind
// k8s.gpu.nvidia.com/claim, as NVIDIA's driver names it), whose devices set
// NVIDIA_VISIBLE_DEVICES, and returns those CDI device IDs; unpreparing removes it. What is
// prepared is kept in prepared.json in the plugin data folder, so a restarted driver unprepares
// what its predecessor prepared, and whoever plays the GPU hardware can read the MIG devices
// that prepare "created".
//
// It appends a line to --status for each thing a caller waits for: "serving <registration
// socket> <dra socket>", "published <slices>" once the apiserver lists the pool's slices,
// "registered" each time the kubelet accepts the registration, "prepared <claim UID>" and
// "unprepared <claim UID>".
package main

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

const (
	cdiVendor = "k8s.gpu.nvidia.com"
	cdiClass  = "claim"
	// cdiVersion is the oldest CDI version that has what the specs use (environment edits),
	// so that any runtime with CDI reads them.
	cdiVersion = "0.5.0"
)

// deviceInfo is what preparing one published device means.
type deviceInfo struct {
	// UUID is the GPU's or MIG device's UUID; empty for a MIG device made at prepare time.
	UUID string `json:"uuid,omitempty"`
	// ParentUUID and Profile describe a MIG device (both) made at prepare time (UUID empty).
	ParentUUID string `json:"parentUUID,omitempty"`
	Profile    string `json:"profile,omitempty"`
	// Shared devices may be allocated to several claims at once (consumable capacity).
	Shared bool `json:"shared,omitempty"`
	// Parent is the whole GPU's device name for a MIG device and for the GPU itself: two
	// devices with the same parent are never prepared for two claims at once unless shared.
	Parent string `json:"parent,omitempty"`
}

type sliceConfig struct {
	Devices        []resourceapi.Device     `json:"devices,omitempty"`
	SharedCounters []resourceapi.CounterSet `json:"sharedCounters,omitempty"`
}

type config struct {
	DriverName string                `json:"driverName"`
	Pool       string                `json:"pool"`
	Slices     []sliceConfig         `json:"slices"`
	Devices    map[string]deviceInfo `json:"devices"`
}

// errSignalled is the cause of a stop asked for by SIGTERM or SIGINT: not an error.
var errSignalled = errors.New("signalled")

// preparedDevice is one device of a prepared claim, as prepared.json keeps it.
type preparedDevice struct {
	Request    string `json:"request"`
	Device     string `json:"device"`
	ShareID    string `json:"shareID,omitempty"`
	UUID       string `json:"uuid"`
	ParentUUID string `json:"parentUUID,omitempty"`
	Profile    string `json:"profile,omitempty"`
	// Created: a MIG device made at prepare time, whose UUID this driver made up.
	Created bool   `json:"created,omitempty"`
	Parent  string `json:"parent,omitempty"`
	Shared  bool   `json:"shared,omitempty"`
	CDIID   string `json:"cdiDeviceID"`
}

type preparedClaim struct {
	Namespace string           `json:"namespace"`
	Name      string           `json:"name"`
	Devices   []preparedDevice `json:"devices"`
}

type driver struct {
	config   config
	cdiDir   string
	prepared string // prepared.json
	status   *statusLog
	cancel   context.CancelCauseFunc
}

type statusLog struct {
	mutex sync.Mutex
	file  *os.File
}

func (s *statusLog) say(format string, args ...any) {
	s.mutex.Lock()
	defer s.mutex.Unlock()
	_, _ = fmt.Fprintf(s.file, format+"\n", args...)
}

// dynamicMigUUID makes up the UUID of a MIG device created for a claim: the same for the same
// claim (prepare must be idempotent, also across restarts), a new one for each new claim, as a
// real MIG device destroyed and created again gets a new UUID.
func dynamicMigUUID(parentUUID, device string, claim types.UID) string {
	sum := sha256.Sum256([]byte(parentUUID + "/" + device + "/" + string(claim)))
	b := sum[:16]
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("MIG-%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

func specPath(dir string, claim types.UID) string {
	return filepath.Join(dir, fmt.Sprintf("%s-%s_%s.json", cdiVendor, cdiClass, claim))
}

func writeAtomically(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func (d *driver) load() (map[types.UID]preparedClaim, error) {
	claims := map[types.UID]preparedClaim{}
	raw, err := os.ReadFile(d.prepared)
	if errors.Is(err, os.ErrNotExist) {
		return claims, nil
	}
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(raw, &claims); err != nil {
		return nil, fmt.Errorf("%s: %w", d.prepared, err)
	}
	return claims, nil
}

func (d *driver) save(claims map[types.UID]preparedClaim) error {
	raw, err := json.MarshalIndent(claims, "", "  ")
	if err != nil {
		return err
	}
	return writeAtomically(d.prepared, raw)
}

// PrepareResourceClaims writes each claim's CDI spec and returns its CDI device IDs.
func (d *driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	known, err := d.load()
	if err != nil {
		return nil, err
	}
	result := map[types.UID]kubeletplugin.PrepareResult{}
	for _, claim := range claims {
		devices, err := d.prepare(claim, known)
		if err != nil {
			result[claim.UID] = kubeletplugin.PrepareResult{Err: err}
			continue
		}
		known[claim.UID] = preparedClaim{Namespace: claim.Namespace, Name: claim.Name, Devices: devices}
		answer := kubeletplugin.PrepareResult{}
		for _, device := range devices {
			var share *types.UID
			if device.ShareID != "" {
				id := types.UID(device.ShareID)
				share = &id
			}
			answer.Devices = append(answer.Devices, kubeletplugin.Device{
				Requests:     []string{device.Request},
				PoolName:     d.config.Pool,
				DeviceName:   device.Device,
				CDIDeviceIDs: []string{device.CDIID},
				ShareID:      share,
			})
		}
		result[claim.UID] = answer
	}
	if err := d.save(known); err != nil {
		return nil, err
	}
	for uid, answer := range result {
		if answer.Err == nil {
			d.status.say("prepared %s", uid)
		}
	}
	return result, nil
}

// prepare writes one claim's CDI spec: one CDI device per allocated device (per share of a
// shared one), each setting NVIDIA_VISIBLE_DEVICES to every UUID the claim got, since a
// container's environment holds one value per name and the claim's devices go to the same
// containers.
func (d *driver) prepare(claim *resourceapi.ResourceClaim, known map[types.UID]preparedClaim) ([]preparedDevice, error) {
	if claim.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s/%s is not allocated", claim.Namespace, claim.Name)
	}
	var devices []preparedDevice
	for _, result := range claim.Status.Allocation.Devices.Results {
		if result.Driver != d.config.DriverName {
			continue
		}
		if result.Pool != d.config.Pool {
			return nil, fmt.Errorf("device %s of claim %s/%s is in pool %s, not this node's %s", result.Device, claim.Namespace, claim.Name, result.Pool, d.config.Pool)
		}
		info, ok := d.config.Devices[result.Device]
		if !ok {
			return nil, fmt.Errorf("claim %s/%s got device %s, which this driver does not publish", claim.Namespace, claim.Name, result.Device)
		}
		device := preparedDevice{
			Request:    result.Request,
			Device:     result.Device,
			UUID:       info.UUID,
			ParentUUID: info.ParentUUID,
			Profile:    info.Profile,
			Parent:     info.Parent,
			Shared:     info.Shared,
		}
		if info.UUID == "" {
			device.UUID = dynamicMigUUID(info.ParentUUID, result.Device, claim.UID)
			device.Created = true
		}
		name := string(claim.UID) + "-" + result.Device
		if result.ShareID != nil {
			device.ShareID = string(*result.ShareID)
			name += "-" + device.ShareID
		}
		device.CDIID = cdiVendor + "/" + cdiClass + "=" + name
		devices = append(devices, device)
	}
	if err := d.exclusive(claim.UID, devices, known); err != nil {
		return nil, err
	}
	var uuids []string
	seen := map[string]bool{}
	for _, device := range devices {
		if !seen[device.UUID] {
			seen[device.UUID] = true
			uuids = append(uuids, device.UUID)
		}
	}
	visible := "NVIDIA_VISIBLE_DEVICES=" + strings.Join(uuids, ",")
	type edits struct {
		Env []string `json:"env"`
	}
	type cdiDevice struct {
		Name           string `json:"name"`
		ContainerEdits edits  `json:"containerEdits"`
	}
	spec := struct {
		CDIVersion string      `json:"cdiVersion"`
		Kind       string      `json:"kind"`
		Devices    []cdiDevice `json:"devices"`
	}{CDIVersion: cdiVersion, Kind: cdiVendor + "/" + cdiClass}
	for _, device := range devices {
		_, name, _ := strings.Cut(device.CDIID, "=")
		spec.Devices = append(spec.Devices, cdiDevice{Name: name, ContainerEdits: edits{Env: []string{visible}}})
	}
	if len(spec.Devices) == 0 {
		return devices, nil
	}
	raw, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := writeAtomically(specPath(d.cdiDir, claim.UID), raw); err != nil {
		return nil, fmt.Errorf("write CDI spec: %w", err)
	}
	return devices, nil
}

// exclusive refuses a device that another prepared claim holds, or whose GPU another claim
// holds through another of its devices (a MIG device of a GPU given whole, or the reverse):
// the scheduler should never allow it, and the driver is the last line of defence. Shared
// devices are exempt (that is what sharing means).
func (d *driver) exclusive(uid types.UID, devices []preparedDevice, known map[types.UID]preparedClaim) error {
	for other, claim := range known {
		if other == uid {
			continue
		}
		for _, held := range claim.Devices {
			for _, device := range devices {
				if device.Shared && held.Shared && device.Device == held.Device {
					continue
				}
				same := held.Device == device.Device
				wholeAndPart := held.Parent != "" && device.Parent != "" && held.Parent == device.Parent &&
					(held.Device == held.Parent || device.Device == device.Parent)
				if same || wholeAndPart {
					return fmt.Errorf("device %s is in use by claim %s/%s (%s)", device.Device, claim.Namespace, claim.Name, held.Device)
				}
			}
		}
	}
	return nil
}

// UnprepareResourceClaims removes the claims' CDI specs; a claim not prepared is no error.
func (d *driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	known, err := d.load()
	if err != nil {
		return nil, err
	}
	result := map[types.UID]error{}
	for _, claim := range claims {
		err := os.Remove(specPath(d.cdiDir, claim.UID))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			result[claim.UID] = err
			continue
		}
		delete(known, claim.UID)
		result[claim.UID] = nil
	}
	if err := d.save(known); err != nil {
		return nil, err
	}
	for uid, err := range result {
		if err == nil {
			d.status.say("unprepared %s", uid)
		}
	}
	return result, nil
}

// HandleError logs background errors (publishing slices, gRPC) and stops on fatal ones.
func (d *driver) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
	if !errors.Is(err, kubeletplugin.ErrRecoverable) {
		d.cancel(fmt.Errorf("%s: %w", msg, err))
	}
}

// WatchHealthStatus is not offered (the health service is turned off at Start).
func (d *driver) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}

// registrations notes each registration the kubelet accepts (NotifyRegistrationStatus).
func (d *driver) registrations(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	answer, err := handler(ctx, req)
	if status, ok := req.(*registerapi.RegistrationStatus); ok && err == nil && status.PluginRegistered {
		d.status.say("registered")
	}
	return answer, err
}

// waitPublished says "published" once the apiserver lists every slice of the pool at its
// newest generation: the wrapper's readiness, and a check that the apiserver took them.
func (d *driver) waitPublished(ctx context.Context, client kubernetes.Interface, node string) {
	selector := fields.Set{
		resourceapi.ResourceSliceSelectorDriver:   d.config.DriverName,
		resourceapi.ResourceSliceSelectorNodeName: node,
	}.String()
	want := len(d.config.Slices)
	for {
		list, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: selector})
		if err == nil {
			newest, count := int64(-1), 0
			for _, slice := range list.Items {
				if slice.Spec.Pool.Name != d.config.Pool {
					continue
				}
				if slice.Spec.Pool.Generation > newest {
					newest, count = slice.Spec.Pool.Generation, 0
				}
				if slice.Spec.Pool.Generation == newest && slice.Spec.Pool.ResourceSliceCount == int64(want) {
					count++
				}
			}
			if count == want {
				d.status.say("published %d", want)
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func main() {
	klog.InitFlags(nil)
	configFile := flag.String("config", "", "JSON file: driver name, pool, slices and devices")
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the identity that publishes ResourceSlices and reads claims")
	nodeName := flag.String("node-name", "", "the node whose ResourceSlices these are")
	registrarDir := flag.String("registrar-dir", kubeletplugin.KubeletRegistryDir, "the kubelet's plugin registration folder")
	pluginDir := flag.String("plugin-data-dir", "", "the plugin's own folder (dra.sock, prepared.json); default /var/lib/kubelet/plugins/<driver>")
	cdiDir := flag.String("cdi-dir", "/var/run/cdi", "where CDI spec files are written")
	statusFile := flag.String("status", "", "file to which status lines are appended")
	flag.Parse()

	fail := func(err error) {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	raw, err := os.ReadFile(*configFile)
	if err != nil {
		fail(err)
	}
	var cfg config
	if err := json.Unmarshal(raw, &cfg); err != nil {
		fail(fmt.Errorf("config: %w", err))
	}
	if cfg.DriverName == "" || cfg.Pool == "" || *nodeName == "" {
		fail(errors.New("driverName and pool (config) and --node-name are required"))
	}
	if *pluginDir == "" {
		*pluginDir = filepath.Join(kubeletplugin.KubeletPluginsDir, cfg.DriverName)
	}
	for _, dir := range []string{*registrarDir, *pluginDir, *cdiDir} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			fail(err)
		}
	}
	status := &statusLog{file: os.Stdout}
	if *statusFile != "" {
		file, err := os.OpenFile(*statusFile, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			fail(err)
		}
		status.file = file
	}
	restConfig, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		fail(fmt.Errorf("kubeconfig: %w", err))
	}
	restConfig.UserAgent = "gpuusage-dra-plugin"
	client, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		fail(err)
	}

	ctx, cancel := context.WithCancelCause(context.Background())
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-signals
		cancel(errSignalled)
	}()
	d := &driver{
		config:   cfg,
		cdiDir:   *cdiDir,
		prepared: filepath.Join(*pluginDir, "prepared.json"),
		status:   status,
		cancel:   cancel,
	}
	helper, err := kubeletplugin.Start(ctx, d,
		kubeletplugin.DriverName(cfg.DriverName),
		kubeletplugin.NodeName(*nodeName),
		kubeletplugin.KubeClient(client),
		kubeletplugin.RegistrarDirectoryPath(*registrarDir),
		kubeletplugin.PluginDataDirectoryPath(*pluginDir),
		kubeletplugin.HealthService(false),
		kubeletplugin.GRPCInterceptor(d.registrations),
	)
	if err != nil {
		fail(fmt.Errorf("start: %w", err))
	}
	status.say("serving %s %s", filepath.Join(*registrarDir, cfg.DriverName+"-reg.sock"), filepath.Join(*pluginDir, "dra.sock"))

	slices := make([]resourceslice.Slice, 0, len(cfg.Slices))
	for _, s := range cfg.Slices {
		slices = append(slices, resourceslice.Slice{Devices: s.Devices, SharedCounters: s.SharedCounters})
	}
	names := make([]string, 0, len(cfg.Devices))
	for name := range cfg.Devices {
		names = append(names, name)
	}
	sort.Strings(names)
	klog.InfoS("publishing", "pool", cfg.Pool, "slices", len(slices), "devices", names)
	// Publishing waits for the informer's first list; a signal meanwhile cancels it, and the
	// sockets are closed (and removed) below either way.
	if err := helper.PublishResources(ctx, resourceslice.DriverResources{
		Pools: map[string]resourceslice.Pool{cfg.Pool: {Slices: slices}},
	}); err != nil && ctx.Err() == nil {
		cancel(fmt.Errorf("publish: %w", err))
	}
	go d.waitPublished(ctx, client, *nodeName)

	<-ctx.Done()
	cause := context.Cause(ctx)
	klog.InfoS("stopping", "cause", cause)
	helper.Stop()
	if !errors.Is(cause, errSignalled) {
		fmt.Fprintln(os.Stderr, cause)
		os.Exit(1)
	}
}
